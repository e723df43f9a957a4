//! Fuzz target `tokenizer_json`: feeds each input to [`sparda::fuzz::tokenizer_json`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::tokenizer_json(data);
    });
}
