//! Fuzz target `torch_pickle`: feeds each input to [`sparda::fuzz::torch_pickle`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::torch_pickle(data);
    });
}
