//! Fuzz target `trace_summarize`: feeds each input to [`sparda::fuzz::trace_summarize`].
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = sparda::fuzz::trace_summarize(data);
    });
}
