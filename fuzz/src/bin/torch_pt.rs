//! Fuzz target `torch_pt`: feeds each input to [`sparda::fuzz::torch_pt`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::torch_pt(data);
    });
}
