//! The device error record: how a kernel reports a failed guard (a
//! position past the RoPE table, more blocks than a launch was sized for,
//! more missed blocks than free slots, a logits row no token can be chosen
//! from) instead of writing stale or empty data silently.
//!
//! The record is [`RECORD_WORDS`] i32 words in pinned, device-mapped host
//! memory ([`DeviceErrors`]), written by `raise_device_error`
//! (kernels/common.cuh) and read by the host after a synchronisation at no
//! cost (no copy):
//!
//! | word | meaning |
//! | --- | --- |
//! | 0 | code: 0 = no error, else a [`DeviceErrorKind`] |
//! | 1 | row of the launch (a sequence of a decode batch, a token of a prefill chunk) |
//! | 2 | layer (as the launch was told) |
//! | 3 | value: the offending number (position, blocks, missed blocks) |
//! | 4 | limit: what the launch allowed (RoPE rows, block cap, free slots) |
//! | 5 | KV head, or −1 when the guard is per row |
//! | 6 | count: the offending entries of a non-finite logits row, else 0 |
//! | 7 | 0 (reserved) |
//!
//! The first error wins: a kernel claims the record with `atomicCAS` on the
//! code (0 → its code) and only the claiming thread writes the other words,
//! so later errors leave it unchanged until the host clears it
//! ([`DeviceErrors::take`]). A kernel given a null record (an
//! [`ErrorSink`] of address 0) keeps its guard but reports nothing.

use crate::cuda::Gpu;
use crate::kv::host_store::PinnedKv;
use crate::sample::LogitsFault;
use crate::{Error, Result};
use std::sync::atomic::{AtomicI32, Ordering};

/// i32 words in the record (32 bytes; see the module doc for the layout).
pub const RECORD_WORDS: usize = 8;

/// Word index of the code.
const W_CODE: usize = 0;
/// Word index of the row.
const W_ROW: usize = 1;
/// Word index of the layer.
const W_LAYER: usize = 2;
/// Word index of the offending value.
const W_VALUE: usize = 3;
/// Word index of the limit.
const W_LIMIT: usize = 4;
/// Word index of the KV head (−1: none).
const W_HEAD: usize = 5;
/// Word index of the count (non-finite logits).
const W_COUNT: usize = 6;

/// Which guard failed (the record's code; `DEVERR_*` in kernels/common.cuh,
/// both must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DeviceErrorKind {
    /// `qkv_rope_append` (kernels/kv_append.cu): a row's position lies
    /// outside the RoPE table; the row's token was neither rotated nor
    /// appended. Value: the position; limit: the table's rows.
    RopePosition,
    /// `select_blocks` (kernels/select.cu): a row has more blocks than the
    /// launch's cap (its shared memory); the row's selection was cleared.
    /// Value: the row's blocks; limit: the cap.
    SelectBlocksCap,
    /// `slot_diff` (kernels/kv_offload.cu): more missed blocks than free
    /// slots; the excess was left unfetched (slot −1). Value: the misses;
    /// limit: the free slots.
    SlotDiffNoSlot,
    /// `argmax_rows`, `argmax_advance` (kernels/argmax.cu) or `sample_rows`
    /// (kernels/sample.cu): a NaN in a logits row (the rule of
    /// [`crate::sample::check_logits`]); the row's id is the argmax of its
    /// other entries. Value: the lowest NaN id; limit: V; count: the NaN
    /// entries. Layer −1 (after the last layer).
    LogitsNan,
    /// As [`DeviceErrorKind::LogitsNan`] for a row without NaN but with a
    /// +∞. Value: the lowest +∞ id; limit: V; count: the +∞ entries.
    LogitsPosInf,
    /// As [`DeviceErrorKind::LogitsNan`] for a row without a finite entry
    /// (all −∞). Value: −1; limit: V; count: V.
    LogitsNoFinite,
}

impl DeviceErrorKind {
    /// Every kind.
    pub const ALL: [DeviceErrorKind; 6] = [
        DeviceErrorKind::RopePosition,
        DeviceErrorKind::SelectBlocksCap,
        DeviceErrorKind::SlotDiffNoSlot,
        DeviceErrorKind::LogitsNan,
        DeviceErrorKind::LogitsPosInf,
        DeviceErrorKind::LogitsNoFinite,
    ];

    /// The record's code for this kind (≥ 1).
    pub fn code(self) -> i32 {
        match self {
            DeviceErrorKind::RopePosition => 1,
            DeviceErrorKind::SelectBlocksCap => 2,
            DeviceErrorKind::SlotDiffNoSlot => 3,
            DeviceErrorKind::LogitsNan => 4,
            DeviceErrorKind::LogitsPosInf => 5,
            DeviceErrorKind::LogitsNoFinite => 6,
        }
    }

    /// The kind of a record code, `None` for 0 or an unknown code.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.code() == code)
    }

    /// The kernel that raises this kind.
    pub fn kernel(self) -> &'static str {
        match self {
            DeviceErrorKind::RopePosition => "qkv_rope_append",
            DeviceErrorKind::SelectBlocksCap => "select_blocks",
            DeviceErrorKind::SlotDiffNoSlot => "slot_diff",
            DeviceErrorKind::LogitsNan
            | DeviceErrorKind::LogitsPosInf
            | DeviceErrorKind::LogitsNoFinite => "argmax/sample",
        }
    }

    /// Whether this kind reports a logits row no token can be chosen from.
    pub fn is_logits(self) -> bool {
        matches!(
            self,
            DeviceErrorKind::LogitsNan
                | DeviceErrorKind::LogitsPosInf
                | DeviceErrorKind::LogitsNoFinite
        )
    }
}

/// A decoded device error record (see the module doc for the fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceError {
    /// Which guard failed.
    pub kind: DeviceErrorKind,
    /// Row of the launch: a sequence's index in a decode batch, a token's
    /// index in a prefill chunk.
    pub row: i32,
    /// Layer the launch worked on.
    pub layer: i32,
    /// KV head, for guards per (row, KV head).
    pub head: Option<i32>,
    /// The offending number (position, blocks, missed blocks).
    pub value: i32,
    /// What the launch allowed (RoPE rows, block cap, free slots; V for
    /// logits).
    pub limit: i32,
    /// The offending entries of a non-finite logits row (0 for the other
    /// kinds).
    pub count: i32,
}

impl DeviceError {
    /// Decodes a record: `Ok(None)` when no error was raised (code 0).
    ///
    /// Errors: [`Error::Cuda`] for a code no kernel writes (a corrupted
    /// record), with every word.
    pub fn from_words(w: &[i32; RECORD_WORDS]) -> Result<Option<DeviceError>> {
        if w[W_CODE] == 0 {
            return Ok(None);
        }
        let kind = DeviceErrorKind::from_code(w[W_CODE]).ok_or_else(|| {
            Error::Cuda(format!(
                "device error record holds unknown code {} (words {w:?})",
                w[W_CODE]
            ))
        })?;
        Ok(Some(DeviceError {
            kind,
            row: w[W_ROW],
            layer: w[W_LAYER],
            head: (w[W_HEAD] >= 0).then_some(w[W_HEAD]),
            value: w[W_VALUE],
            limit: w[W_LIMIT],
            count: w[W_COUNT],
        }))
    }

    /// The record words a kernel writes for this error (the inverse of
    /// [`DeviceError::from_words`]).
    pub fn to_words(&self) -> [i32; RECORD_WORDS] {
        let mut w = [0i32; RECORD_WORDS];
        w[W_CODE] = self.kind.code();
        w[W_ROW] = self.row;
        w[W_LAYER] = self.layer;
        w[W_VALUE] = self.value;
        w[W_LIMIT] = self.limit;
        w[W_HEAD] = self.head.unwrap_or(-1);
        w[W_COUNT] = self.count;
        w
    }

    /// The [`LogitsFault`] a logits kind reports (the same as
    /// [`crate::sample::check_logits`] gives for the row), `None` for the
    /// other kinds.
    pub fn logits_fault(&self) -> Option<LogitsFault> {
        let vocab = self.limit.max(0) as usize;
        let (id, count) = (self.value.max(0) as usize, self.count.max(0) as usize);
        match self.kind {
            DeviceErrorKind::LogitsNan => Some(LogitsFault::Nan { id, count, vocab }),
            DeviceErrorKind::LogitsPosInf => Some(LogitsFault::PosInf { id, count, vocab }),
            DeviceErrorKind::LogitsNoFinite => Some(LogitsFault::NoFinite { vocab }),
            _ => None,
        }
    }

    /// The crate error for this record: for a logits kind
    /// [`Error::NonFiniteLogits`] naming the sequence (the row; the decode
    /// step is for the caller to add, [`Error::locate`]) and the fault,
    /// worded as on the CPU; else [`Error::Limit`] naming the kernel,
    /// layer, row (and KV head) and the numbers.
    pub fn to_error(&self) -> Error {
        match self.logits_fault() {
            Some(f) => Error::NonFiniteLogits {
                step: None,
                sequence: Some(self.row.max(0) as usize),
                layer: None,
                what: f.to_string(),
            },
            None => Error::Limit(format!("device check: {self}")),
        }
    }
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (l, r, v, lim) = (self.layer, self.row, self.value, self.limit);
        if let Some(fault) = self.logits_fault() {
            return write!(f, "{} (row {r}): {fault}", self.kind.kernel());
        }
        let head = self
            .head
            .map(|h| format!(", KV head {h}"))
            .unwrap_or_default();
        write!(f, "{} (layer {l}, row {r}{head}): ", self.kind.kernel())?;
        match self.kind {
            DeviceErrorKind::RopePosition => write!(
                f,
                "position {v} lies outside the RoPE table of {lim} rows; the token was not appended"
            ),
            DeviceErrorKind::SelectBlocksCap => write!(
                f,
                "{v} blocks, more than the {lim} the launch was sized for; the selection was cleared"
            ),
            DeviceErrorKind::SlotDiffNoSlot => write!(
                f,
                "{v} missed blocks but {lim} free slots; {} blocks were left unfetched",
                v.saturating_sub(lim)
            ),
            DeviceErrorKind::LogitsNan
            | DeviceErrorKind::LogitsPosInf
            | DeviceErrorKind::LogitsNoFinite => Ok(()),
        }
    }
}

/// Where a kernel reports a failed guard: the device address of a record
/// ([`DeviceErrors::device_ptr`]; 0 = report nothing, the guard still
/// skips the bad row) and the layer the launch works on (copied into the
/// record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorSink {
    /// Device address of the i32 record, or 0.
    pub record: u64,
    /// Layer index reported with an error.
    pub layer: usize,
}

impl ErrorSink {
    /// No reporting (a null record).
    pub const NONE: ErrorSink = ErrorSink {
        record: 0,
        layer: 0,
    };

    /// The layer as the kernels' i32 argument.
    ///
    /// Errors: [`Error::Input`] past i32.
    pub(crate) fn layer_arg(&self) -> Result<i32> {
        i32::try_from(self.layer)
            .map_err(|_| Error::Input(format!("layer {} exceeds i32", self.layer)))
    }
}

/// Reads the record `words` (after a synchronisation) and, when an error
/// was raised, clears it and returns that error.
///
/// Errors: the raised error ([`DeviceError::to_error`]); [`Error::Cuda`]
/// for an unknown code (cleared as well).
pub(crate) fn take_record(words: &[AtomicI32; RECORD_WORDS]) -> Result<()> {
    if words[W_CODE].load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let snapshot: [i32; RECORD_WORDS] = std::array::from_fn(|i| words[i].load(Ordering::Acquire));
    // Fields first, code last: a kernel claims the record by the code.
    for w in words.iter().skip(1) {
        w.store(0, Ordering::Relaxed);
    }
    words[W_CODE].store(0, Ordering::Release);
    match DeviceError::from_words(&snapshot)? {
        Some(e) => Err(e.to_error()),
        None => Ok(()),
    }
}

/// The device error record of an engine (or a check): [`RECORD_WORDS`]
/// i32 in pinned, device-mapped host memory, so kernels write it through
/// its device address and the host reads it without a copy. Its address is
/// fixed for its lifetime (CUDA graphs capture it). Zero (no error) when
/// made and after every [`DeviceErrors::take`].
pub struct DeviceErrors {
    mem: PinnedKv,
}

impl std::fmt::Debug for DeviceErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceErrors")
            .field("device_ptr", &format_args!("{:#x}", self.mem.device_ptr()))
            .finish()
    }
}

impl DeviceErrors {
    /// Allocates a cleared record on `gpu`'s context.
    ///
    /// Errors: [`Error::Cuda`] when pinned memory cannot be had.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let mem = PinnedKv::new(gpu, RECORD_WORDS * 4)?;
        let e = DeviceErrors { mem };
        for w in e.words() {
            w.store(0, Ordering::Relaxed);
        }
        Ok(e)
    }

    fn words(&self) -> &[AtomicI32; RECORD_WORDS] {
        // SAFETY: the buffer holds RECORD_WORDS·4 bytes, is page-aligned and
        // lives as long as `self`; it is only ever accessed atomically (host)
        // or by kernels through its device address.
        unsafe { &*(self.mem.host_ptr() as *const [AtomicI32; RECORD_WORDS]) }
    }

    /// The record's device address (what kernels get).
    pub fn device_ptr(&self) -> u64 {
        self.mem.device_ptr()
    }

    /// An [`ErrorSink`] reporting to this record for layer `layer`.
    pub fn sink(&self, layer: usize) -> ErrorSink {
        ErrorSink {
            record: self.device_ptr(),
            layer,
        }
    }

    /// The raised error, if any, without clearing it. Call after the
    /// kernels that may raise it have completed (a synchronisation).
    ///
    /// Errors: [`Error::Cuda`] for an unknown code.
    pub fn peek(&self) -> Result<Option<DeviceError>> {
        let w = self.words();
        let snapshot: [i32; RECORD_WORDS] = std::array::from_fn(|i| w[i].load(Ordering::Acquire));
        DeviceError::from_words(&snapshot)
    }

    /// Turns a raised error into its [`Error`] and clears the record. Call
    /// after the kernels that may raise it have completed (a
    /// synchronisation); reading costs no device work.
    ///
    /// Errors: the raised error ([`DeviceError::to_error`]: an
    /// [`Error::Limit`] naming the kernel, layer, row, KV head and numbers,
    /// or [`Error::NonFiniteLogits`] naming the sequence); [`Error::Cuda`]
    /// for an unknown code.
    pub fn take(&self) -> Result<()> {
        take_record(self.words())
    }

    /// Clears the record (no GPU work that may raise an error in flight).
    pub fn clear(&self) {
        let _ = take_record(self.words());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(w: [i32; RECORD_WORDS]) -> [AtomicI32; RECORD_WORDS] {
        w.map(AtomicI32::new)
    }

    #[test]
    fn codes_round_trip_and_zero_is_no_error() {
        for k in DeviceErrorKind::ALL {
            assert!(k.code() >= 1);
            assert_eq!(DeviceErrorKind::from_code(k.code()), Some(k));
        }
        assert_eq!(DeviceErrorKind::from_code(0), None);
        assert_eq!(DeviceErrorKind::from_code(99), None);
        assert_eq!(DeviceError::from_words(&[0; RECORD_WORDS]).unwrap(), None);
    }

    #[test]
    fn rope_position_record_names_kernel_layer_row_and_numbers() {
        // [code, row, layer, value, limit, head, 0, 0] as kernels/common.cuh writes it.
        let w = [1, 3, 17, 8192, 8192, -1, 0, 0];
        let e = DeviceError::from_words(&w).unwrap().unwrap();
        assert_eq!(
            e,
            DeviceError {
                kind: DeviceErrorKind::RopePosition,
                row: 3,
                layer: 17,
                head: None,
                value: 8192,
                limit: 8192,
                count: 0
            }
        );
        assert_eq!(e.to_words(), w);
        let msg = e.to_error().to_string();
        assert!(matches!(e.to_error(), Error::Limit(_)));
        for part in [
            "qkv_rope_append",
            "layer 17",
            "row 3",
            "position 8192",
            "8192 rows",
        ] {
            assert!(msg.contains(part), "{part:?} missing in {msg:?}");
        }
        assert!(!msg.contains("KV head"), "{msg}");
    }

    #[test]
    fn select_and_slot_diff_records_name_the_head_and_numbers() {
        let s = DeviceError::from_words(&[2, 1, 5, 300, 257, 1, 0, 0])
            .unwrap()
            .unwrap();
        assert_eq!(s.kind, DeviceErrorKind::SelectBlocksCap);
        let msg = s.to_error().to_string();
        for part in [
            "select_blocks",
            "layer 5",
            "row 1",
            "KV head 1",
            "300 blocks",
            "257",
        ] {
            assert!(msg.contains(part), "{part:?} missing in {msg:?}");
        }
        let d = DeviceError::from_words(&[3, 0, 9, 6, 4, 0, 0, 0])
            .unwrap()
            .unwrap();
        assert_eq!(d.kind, DeviceErrorKind::SlotDiffNoSlot);
        assert_eq!(d.head, Some(0));
        let msg = d.to_error().to_string();
        for part in [
            "slot_diff",
            "layer 9",
            "row 0",
            "KV head 0",
            "6 missed blocks",
            "4 free slots",
            "2 blocks were left unfetched",
        ] {
            assert!(msg.contains(part), "{part:?} missing in {msg:?}");
        }
    }

    #[test]
    fn logits_records_read_as_the_cpu_check_words_them() {
        // [code, row, layer, value, limit, head, count, 0] as kernels/argmax.cu writes them.
        let mut row = vec![0.5f32; 1000];
        row[17] = f32::NAN;
        row[400] = f32::NAN;
        row[999] = f32::NAN;
        let want = crate::sample::check_logits(&row).unwrap_err();
        let e = DeviceError::from_words(&[4, 2, -1, 17, 1000, -1, 3, 0])
            .unwrap()
            .unwrap();
        assert_eq!(e.kind, DeviceErrorKind::LogitsNan);
        assert_eq!(e.logits_fault(), Some(want));
        assert_eq!(e.to_words(), [4, 2, -1, 17, 1000, -1, 3, 0]);
        match e.to_error() {
            Error::NonFiniteLogits {
                step: None,
                sequence: Some(2),
                layer: None,
                what,
            } => assert_eq!(what, "NaN at id 17 (3 of 1000 entries NaN)"),
            other => panic!("expected NonFiniteLogits, got {other:?}"),
        }
        let inf = DeviceError::from_words(&[5, 0, -1, 9, 16, -1, 2, 0])
            .unwrap()
            .unwrap();
        assert_eq!(
            inf.to_error().to_string().split(';').next().unwrap(),
            "non-finite logits at sequence 0: +inf at id 9 (2 of 16 entries +inf)"
        );
        let none = DeviceError::from_words(&[6, 1, -1, -1, 16, -1, 16, 0])
            .unwrap()
            .unwrap();
        assert_eq!(
            none.logits_fault(),
            Some(crate::sample::LogitsFault::NoFinite { vocab: 16 })
        );
        assert_eq!(
            none.to_string(),
            "argmax/sample (row 1): no finite logit (all 16 entries -inf)"
        );
    }

    #[test]
    fn unknown_code_is_a_cuda_error_with_the_words() {
        match DeviceError::from_words(&[42, 1, 2, 3, 4, 5, 0, 0]) {
            Err(Error::Cuda(m)) => assert!(m.contains("unknown code 42"), "{m}"),
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
    }

    #[test]
    fn take_reports_once_and_clears() {
        let r = record([0; RECORD_WORDS]);
        assert!(take_record(&r).is_ok());
        let e = DeviceError {
            kind: DeviceErrorKind::SlotDiffNoSlot,
            row: 2,
            layer: 4,
            head: Some(1),
            value: 9,
            limit: 3,
            count: 0,
        };
        let r = record(e.to_words());
        match take_record(&r) {
            Err(Error::Limit(m)) => assert_eq!(m, format!("device check: {e}")),
            other => panic!("expected Error::Limit, got {other:?}"),
        }
        assert!(r.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        assert!(take_record(&r).is_ok(), "a second read finds it cleared");
        // An unknown code is reported and cleared too.
        let r = record([7, 0, 0, 0, 0, 0, 0, 0]);
        assert!(matches!(take_record(&r), Err(Error::Cuda(_))));
        assert!(take_record(&r).is_ok());
    }

    #[test]
    fn sink_layer_fits_i32() {
        assert_eq!(ErrorSink::NONE.record, 0);
        let s = ErrorSink {
            record: 8,
            layer: 31,
        };
        assert_eq!(s.layer_arg().unwrap(), 31);
        let big = ErrorSink {
            record: 8,
            layer: usize::MAX,
        };
        assert!(big.layer_arg().is_err());
    }
}
