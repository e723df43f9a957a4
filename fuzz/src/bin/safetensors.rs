//! Fuzz target `safetensors`: feeds each input to [`sparda::fuzz::safetensors`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::safetensors(data);
    });
}
