//! The GPU batch codec: LZ4 compress and decompress of 4 KiB pages with in-tree PTX kernels.
//!
//! SKELETON: filled in by the GPU work. Contract: `probe()` never panics and says why there is
//! no GPU; `GpuCodec` implements `codec::BatchCodec`.

/// Whether a GPU can be used, and if not, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuProbe {
    Available { name: String },
    Unavailable { reason: String },
}

/// Probe for a usable GPU without panicking.
pub fn probe() -> GpuProbe {
    GpuProbe::Unavailable {
        reason: "GPU backend not built yet".into(),
    }
}
