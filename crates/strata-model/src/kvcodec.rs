//! K/V rows in their stored dtype ([`Dtype`]): written (quantized) once per token and layer,
//! read back a head at a time by the attention kernels, never as a whole dequantized copy.
//!
//! * `f16`: IEEE half, little-endian.
//! * `q8_0`: ggml's block format and its reference quantizer (`quantize_row_q8_0_ref`): per 32
//!   values, `d = max|x| / 127` stored as f16, then `round(x / d)` (halves away from zero) as
//!   signed bytes; a value reads back as `q · d` with the stored (f16) `d`.
//! * `fp8_e4m3`: OCP's E4M3 ("FN": no infinities, ±448 at most, NaN `0x7f`/`0xff`), rounded to
//!   nearest even, saturated at ±448, as the GPU engines store K/V.

use half::f16;
use strata_kv::dtype::Dtype;

/// Writes `x` as `dtype` into `out` (`dtype.bytes_of(x.len())` bytes). Panics on a length that
/// does not hold whole blocks or an output of another size: callers size both from the layout.
pub fn encode(dtype: Dtype, x: &[f32], out: &mut [u8]) {
    assert_eq!(Some(out.len()), dtype.bytes_of(x.len()), "{dtype} row size");
    match dtype {
        Dtype::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        Dtype::Q8_0 => {
            for (o, xb) in out.chunks_exact_mut(34).zip(x.chunks_exact(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                for (q, &v) in o[2..].iter_mut().zip(xb) {
                    *q = ((v * id).round() as i8) as u8;
                }
            }
        }
        Dtype::Fp8E4m3 => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = fp8_e4m3_of(v);
            }
        }
        Dtype::F32 | Dtype::Bf16 => panic!("{dtype} is not a K/V dtype"),
    }
}

/// Reads `out.len()` values stored as `dtype` from `bytes` (`dtype.bytes_of(out.len())`).
pub fn decode(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(bytes.len()),
        dtype.bytes_of(out.len()),
        "{dtype} row size"
    );
    match dtype {
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Dtype::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (v, &q) in o.iter_mut().zip(&b[2..]) {
                    *v = (q as i8) as f32 * d;
                }
            }
        }
        Dtype::Fp8E4m3 => {
            let t = fp8_table();
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = t[b as usize];
            }
        }
        Dtype::F32 | Dtype::Bf16 => panic!("{dtype} is not a K/V dtype"),
    }
}

/// The value of every E4M3 byte.
fn fp8_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| fp8_e4m3_value(b as u8)))
}

fn fp8_e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0xf && m == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m as f32 / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * mag
}

/// The E4M3 byte nearest `v` (ties to even), saturated at ±448; NaN stays NaN.
fn fp8_e4m3_of(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(448.0);
    // The largest magnitude ≤ a (bytes 0..=0x7e are increasing), then whichever of it and
    // the next is nearer (even on a tie).
    let t = fp8_table();
    let mut lo = (t[..=0x7e].partition_point(|&x| x <= a) - 1) as u8;
    if lo < 0x7e {
        let (x, y) = (t[lo as usize], t[lo as usize + 1]);
        let up = (a - x) > (y - a) || ((a - x) == (y - a) && lo & 1 == 1);
        if up {
            lo += 1;
        }
    }
    sign | lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(d: Dtype, x: &[f32]) -> Vec<f32> {
        let mut b = vec![0u8; d.bytes_of(x.len()).unwrap()];
        encode(d, x, &mut b);
        let mut y = vec![0f32; x.len()];
        decode(d, &b, &mut y);
        y
    }

    #[test]
    fn q8_0_is_ggmls_block_format() {
        // One block: the largest magnitude maps to ±127, the scale is stored in f16.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.25).collect();
        let mut b = vec![0u8; 34];
        encode(Dtype::Q8_0, &x, &mut b);
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        assert!((d - 4.0 / 127.0).abs() < 1e-5, "{d}");
        assert_eq!(b[2] as i8, -127);
        // 0.25 / (4 / 127) = 7.9375: rounds to 8.
        assert_eq!(b[2 + 17] as i8, 8);
        let y = round_trip(Dtype::Q8_0, &x);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= d / 2.0 + 1e-6, "{a} vs {b}");
        }
        // An all-zero block has scale 0 and reads back zeros.
        assert_eq!(round_trip(Dtype::Q8_0, &[0.0; 32]), vec![0.0; 32]);
    }

    #[test]
    fn fp8_e4m3_rounds_to_nearest_even_and_saturates() {
        assert_eq!(fp8_e4m3_value(0x7e), 448.0);
        assert_eq!(fp8_e4m3_value(0x08), 2f32.powi(-6));
        assert_eq!(fp8_e4m3_value(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_value(0x7f).is_nan());
        assert_eq!(fp8_e4m3_of(1.0), 0x38);
        assert_eq!(fp8_e4m3_of(-1.0), 0xb8);
        assert_eq!(fp8_e4m3_of(1e6), 0x7e);
        assert_eq!(fp8_e4m3_of(-1e6), 0xfe);
        // 1.0625 lies halfway between 1.0 (mantissa 0) and 1.125 (1): to the even one.
        assert_eq!(fp8_e4m3_of(1.0625), 0x38);
        // 1.1875 between 1.125 (1) and 1.25 (2): to 2.
        assert_eq!(fp8_e4m3_of(1.1875), 0x3a);
        // Every byte but NaN reads back to itself.
        for b in (0..=0xffu8).filter(|b| b & 0x7f != 0x7f) {
            let v = fp8_e4m3_value(b);
            let back = fp8_e4m3_of(v);
            assert!(
                back == b || (v == 0.0 && back & 0x7f == 0),
                "{b:#x} → {v} → {back:#x}"
            );
        }
        let x = [0.3f32, -2.7, 100.0, 0.001];
        for (a, b) in x.iter().zip(round_trip(Dtype::Fp8E4m3, &x)) {
            assert!(
                (a - b).abs() <= a.abs() / 16.0 + 2f32.powi(-10),
                "{a} vs {b}"
            );
        }
    }

    #[test]
    fn f16_round_trips_as_before() {
        let x = [1.5f32, -0.1, 65504.0];
        let y = round_trip(Dtype::F16, &x);
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(f16::from_f32(*a).to_f32(), *b);
        }
    }
}
