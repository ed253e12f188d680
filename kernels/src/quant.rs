//! GGML tensor element types as they are stored in GGUF files, and their reference
//! (scalar, obviously-right) dequantization.
//!
//! Rules this module keeps:
//! - Only the layouts; no kernels. The CPU kernels re-lay these blocks out at load
//!   (see [`crate::cpu::packed`]) and are tested against [`dequantize_row`].
//! - Block layouts follow ggml exactly (`ggml-common.h`): a block of 32 weights with an
//!   fp16 scale `d` (and for Q4_1 an fp16 minimum `m`).

use half::{bf16, f16};

/// Number of weights in one quantization block of the 32-wide ggml formats.
pub const QK: usize = 32;

/// The tensor element types the engine can load.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    /// 32 weights: fp16 `d`, 16 bytes of 4-bit `q`; value = d * (q - 8).
    Q4_0,
    /// 32 weights: fp16 `d`, fp16 `m`, 16 bytes of 4-bit `q`; value = d * q + m.
    Q4_1,
    /// 32 weights: fp16 `d`, 32 signed bytes `q`; value = d * q.
    Q8_0,
}

impl GgmlType {
    /// Maps a ggml type id (as written in GGUF tensor infos) to a supported type.
    /// Returns `Err(name)` with ggml's name of the type when it is known but unsupported.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => return Err(ggml_type_name(other).to_string()),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }

    /// Number of elements in one block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => QK,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, Self::Q4_0 | Self::Q4_1 | Self::Q8_0)
    }

    /// Bytes of a row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_len()).then(|| n / self.block_len() * self.block_bytes())
    }
}

/// The names ggml gives its type ids, used to say which type a file needs.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantizes one row of `out.len()` elements stored as `ty` in `bytes`.
///
/// This is the reference every kernel is checked against: plain scalar code that
/// follows ggml's definitions.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(Some(bytes.len()), ty.row_bytes(n), "row size mismatch for {}", ty.name());
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    o[j] = ((blk[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((blk[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let d = f16_at(blk, 0);
                let m = f16_at(blk, 2);
                for j in 0..16 {
                    o[j] = (blk[4 + j] & 0x0f) as f32 * d + m;
                    o[j + 16] = (blk[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = f16_at(blk, 0);
                for j in 0..QK {
                    o[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
        }
    }
}

/// Quantizes `src` (a multiple of 32 long) to ggml blocks of `ty`, the way ggml's
/// reference quantizers do. Used by tests and by `random:` models.
pub fn quantize_row(ty: GgmlType, src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(src.len()).expect("whole blocks"));
    match ty {
        GgmlType::F32 => src.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => src.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => src.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q4_0 => {
            for blk in src.chunks_exact(QK) {
                // ggml: d = max / -8 where max is the value of largest magnitude.
                let max = blk.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let q0 = ((blk[j] * id + 8.5) as i32).min(15) as u8;
                    let q1 = ((blk[j + 16] * id + 8.5) as i32).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        GgmlType::Q4_1 => {
            for blk in src.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let q0 = (((blk[j] - min) * id + 0.5) as i32).min(15) as u8;
                    let q1 = (((blk[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        GgmlType::Q8_0 => {
            for blk in src.chunks_exact(QK) {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for v in blk {
                    out.push((v * id).round() as i8 as u8);
                }
            }
        }
    }
    out
}
