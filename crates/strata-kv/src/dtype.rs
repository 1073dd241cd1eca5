//! Element types of cached state: how many bytes a row of `n` values takes.
//!
//! K/V may be stored quantized (`--kv-cache-dtype`, as llama.cpp's `-ctk` / `-ctv` and the GPU
//! engines' `--kv-cache-dtype` store it): `q8_0` is ggml's block format (32 values: an f16
//! scale and 32 signed bytes, 34 bytes), `fp8_e4m3` one byte a value. The other types are the
//! plain ones models define their state in.

/// One element type of a pool kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    /// ggml's Q8_0: blocks of 32 values, an f16 scale and 32 signed bytes each.
    Q8_0,
    /// One byte a value: 4 exponent bits, 3 mantissa bits.
    Fp8E4m3,
}

impl Dtype {
    /// What `--kv-cache-dtype` accepts, in the order it lists them.
    pub const KV: [Dtype; 3] = [Dtype::F16, Dtype::Q8_0, Dtype::Fp8E4m3];

    /// The name flags and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Q8_0 => "q8_0",
            Dtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// A K/V dtype by name (one of [`Dtype::KV`]).
    pub fn parse_kv(s: &str) -> Option<Dtype> {
        Dtype::KV.into_iter().find(|d| d.name() == s)
    }

    /// Values per block: a row must hold whole blocks.
    pub fn block(self) -> usize {
        match self {
            Dtype::Q8_0 => 32,
            _ => 1,
        }
    }

    /// Bytes of a row of `values` values; None when the row does not hold whole blocks or
    /// the size overflows.
    pub fn bytes_of(self, values: usize) -> Option<usize> {
        if !values.is_multiple_of(self.block()) {
            return None;
        }
        match self {
            Dtype::F32 => values.checked_mul(4),
            Dtype::F16 | Dtype::Bf16 => values.checked_mul(2),
            Dtype::Q8_0 => (values / 32).checked_mul(34),
            Dtype::Fp8E4m3 => Some(values),
        }
    }

    /// The plain type of `bytes` bytes a value (1: fp8, 2: bf16, 4: f32).
    pub fn of_width(bytes: usize) -> Option<Dtype> {
        match bytes {
            1 => Some(Dtype::Fp8E4m3),
            2 => Some(Dtype::Bf16),
            4 => Some(Dtype::F32),
            _ => None,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_per_type() {
        // SmolLM2: 3 KV heads of 64 values.
        assert_eq!(Dtype::F16.bytes_of(192), Some(384));
        assert_eq!(Dtype::Q8_0.bytes_of(192), Some(204));
        assert_eq!(Dtype::Fp8E4m3.bytes_of(192), Some(192));
        assert_eq!(Dtype::F32.bytes_of(3), Some(12));
        // Q8_0 holds whole blocks of 32 only.
        assert_eq!(Dtype::Q8_0.bytes_of(48), None);
        assert_eq!(Dtype::Q8_0.bytes_of(usize::MAX - 31), None);
        assert_eq!(Dtype::F32.bytes_of(usize::MAX), None);
    }

    #[test]
    fn kv_names_round_trip_and_others_are_refused() {
        for d in Dtype::KV {
            assert_eq!(Dtype::parse_kv(d.name()), Some(d));
        }
        assert_eq!(Dtype::parse_kv("f32"), None);
        assert_eq!(Dtype::parse_kv("q4_0"), None);
        assert_eq!(Dtype::parse_kv("Q8_0"), None);
    }
}
