//! Fuzz target `shard_index`: feeds each input to [`sparda::fuzz::shard_index`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::shard_index(data);
    });
}
