//! Fuzz target `config_json`: feeds each input to [`sparda::fuzz::config_json`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::config_json(data);
    });
}
