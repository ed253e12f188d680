//! Weight matrices re-laid out at load time for the CPU matmul kernels.
//!
//! A matrix of `rows × cols` is cut into *tiles* of [`TILE_ROWS`] = 16 rows. Within a
//! tile, the data of each 32-column block is interleaved across the 16 rows so that one
//! 64-byte vector load feeds all 16 rows at once and the integer dot products land in
//! one lane per row: no horizontal sums anywhere in the kernels.
//!
//! Tile layout (all tiles the same size, tiles back to back, 64-byte aligned):
//! ```text
//! quantized: [ qs: nb × QSB bytes ][ d: nb × 16 × f16 ][ m: nb × 16 × f16, Q4Min only ]
//! float:     [ w: nb × 32 × 16 elements of the dtype, element (k, r) at k*16 + r ]
//! ```
//! 4-bit `qs` of one block: four 64-byte groups; group j holds for row r at bytes
//! `r*4 + i` (i < 4) the weight `4j+i` in the low nibble and `16+4j+i` in the high one.
//! 8-bit `qs`: eight 64-byte groups; group g holds weight `4g+i` of row r at `r*4 + i`,
//! stored as `q + 128` (an unsigned byte for `vpdpbusd`).
//!
//! The re-layout is lossless: every kind keeps the file's values bit for bit, so
//! [`PackedMatrix::dequantize_row`] equals [`crate::quant::dequantize_row`] exactly.

use half::{bf16, f16};

use crate::quant::{f16_at, GgmlType, QK};
use crate::KernelError;

pub const TILE_ROWS: usize = 16;

/// How a packed matrix stores its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedKind {
    /// From Q4_1: 4-bit q, fp16 scale d and fp16 minimum m; value = d*q + m.
    Q4Min,
    /// From Q4_0: 4-bit q, fp16 d; value = d*(q - 8).
    Q4Off8,
    /// From Q8_0: q + 128 in a byte, fp16 d; value = d*q.
    Q8Off128,
    F32,
    F16,
    BF16,
}

impl PackedKind {
    pub fn is_quantized(self) -> bool {
        matches!(self, Self::Q4Min | Self::Q4Off8 | Self::Q8Off128)
    }

    /// Bytes of quantized values per (tile, block).
    pub(crate) fn qs_bytes(self) -> usize {
        match self {
            Self::Q4Min | Self::Q4Off8 => 256,
            Self::Q8Off128 => 512,
            Self::F32 => 32 * 16 * 4,
            Self::F16 | Self::BF16 => 32 * 16 * 2,
        }
    }

    fn has_scales(self) -> bool {
        self.is_quantized()
    }

    fn has_min(self) -> bool {
        self == Self::Q4Min
    }

    /// Bytes one weight costs in memory traffic, for bandwidth figures.
    pub fn bits_per_weight(self) -> f64 {
        let per_block = self.qs_bytes() as f64
            + if self.has_scales() { 32.0 } else { 0.0 }
            + if self.has_min() { 32.0 } else { 0.0 };
        per_block * 8.0 / (TILE_ROWS * QK) as f64
    }
}

/// 64-byte aligned storage.
#[derive(Clone)]
#[repr(C, align(64))]
struct Line([u8; 64]);

pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub kind: PackedKind,
    /// The GGUF/safetensors type this came from (for reports).
    pub source: GgmlType,
    pub(crate) n_tiles: usize,
    pub(crate) nb: usize,
    pub(crate) tile_bytes: usize,
    data: Vec<Line>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedMatrix({}x{} {:?})", self.rows, self.cols, self.kind)
    }
}

impl PackedMatrix {
    /// Packs a row-major matrix stored as ggml type `ty` (rows back to back, as in GGUF).
    pub fn from_ggml(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<Self, KernelError> {
        if cols == 0 || rows == 0 || !cols.is_multiple_of(QK) {
            return Err(KernelError::Shape(format!(
                "matrix {rows}x{cols}: the number of columns must be a positive multiple of {QK}"
            )));
        }
        let row_bytes = ty.row_bytes(cols).expect("cols is a multiple of 32");
        if bytes.len() != rows * row_bytes {
            return Err(KernelError::Shape(format!(
                "matrix {rows}x{cols} of {} needs {} bytes, got {}",
                ty.name(),
                rows * row_bytes,
                bytes.len()
            )));
        }
        let kind = match ty {
            GgmlType::Q4_1 => PackedKind::Q4Min,
            GgmlType::Q4_0 => PackedKind::Q4Off8,
            GgmlType::Q8_0 => PackedKind::Q8Off128,
            GgmlType::F32 => PackedKind::F32,
            GgmlType::F16 => PackedKind::F16,
            GgmlType::BF16 => PackedKind::BF16,
        };
        let nb = cols / QK;
        let n_tiles = rows.div_ceil(TILE_ROWS);
        let mut tile_bytes = nb * kind.qs_bytes();
        if kind.has_scales() {
            tile_bytes += nb * 32;
        }
        if kind.has_min() {
            tile_bytes += nb * 32;
        }
        debug_assert_eq!(tile_bytes % 32, 0);
        let tile_bytes = tile_bytes.next_multiple_of(64);
        let mut m = PackedMatrix {
            rows,
            cols,
            kind,
            source: ty,
            n_tiles,
            nb,
            tile_bytes,
            data: vec![Line([0; 64]); n_tiles * tile_bytes / 64],
        };
        for r in 0..rows {
            m.pack_row(r, &bytes[r * row_bytes..(r + 1) * row_bytes]);
        }
        Ok(m)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.data.len() * 64;
        // SAFETY: `Line` is a plain 64-byte array with no padding.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, len) }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: as in `bytes_mut`.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 64) }
    }

    /// Offsets inside a tile: (qs of block b, d of block b, m of block b).
    #[inline]
    pub(crate) fn offsets(&self, b: usize) -> (usize, usize, usize) {
        let qsb = self.kind.qs_bytes();
        let d0 = self.nb * qsb;
        let m0 = d0 + self.nb * 32;
        (b * qsb, d0 + b * 32, m0 + b * 32)
    }

    fn pack_row(&mut self, r: usize, row: &[u8]) {
        let (tile, lane) = (r / TILE_ROWS, r % TILE_ROWS);
        let kind = self.kind;
        let nb = self.nb;
        let tile_bytes = self.tile_bytes;
        let offs: Vec<(usize, usize, usize)> = (0..nb).map(|b| self.offsets(b)).collect();
        let t = &mut self.bytes_mut()[tile * tile_bytes..(tile + 1) * tile_bytes];
        for (b, &(qs, d, m)) in offs.iter().enumerate() {
            match kind {
                PackedKind::Q4Min | PackedKind::Q4Off8 => {
                    let (blk, q0) = if kind == PackedKind::Q4Min {
                        (&row[b * 20..b * 20 + 20], 4)
                    } else {
                        (&row[b * 18..b * 18 + 18], 2)
                    };
                    t[d + lane * 2..d + lane * 2 + 2].copy_from_slice(&blk[0..2]);
                    if kind == PackedKind::Q4Min {
                        t[m + lane * 2..m + lane * 2 + 2].copy_from_slice(&blk[2..4]);
                    }
                    let q = |k: usize| {
                        if k < 16 {
                            blk[q0 + k] & 0x0f
                        } else {
                            blk[q0 + k - 16] >> 4
                        }
                    };
                    for j in 0..4 {
                        for i in 0..4 {
                            t[qs + j * 64 + lane * 4 + i] = q(4 * j + i) | (q(16 + 4 * j + i) << 4);
                        }
                    }
                }
                PackedKind::Q8Off128 => {
                    let blk = &row[b * 34..b * 34 + 34];
                    t[d + lane * 2..d + lane * 2 + 2].copy_from_slice(&blk[0..2]);
                    for g in 0..8 {
                        for i in 0..4 {
                            t[qs + g * 64 + lane * 4 + i] = blk[2 + 4 * g + i] ^ 0x80;
                        }
                    }
                }
                PackedKind::F32 | PackedKind::F16 | PackedKind::BF16 => {
                    let es = if kind == PackedKind::F32 { 4 } else { 2 };
                    for k in 0..QK {
                        let src = (b * QK + k) * es;
                        let dst = qs + (k * TILE_ROWS + lane) * es;
                        t[dst..dst + es].copy_from_slice(&row[src..src + es]);
                    }
                }
            }
        }
    }

    /// The bytes of tile `tile`.
    #[inline]
    pub(crate) fn tile(&self, tile: usize) -> &[u8] {
        &self.bytes()[tile * self.tile_bytes..(tile + 1) * self.tile_bytes]
    }

    /// Dequantizes block `b` of a tile into `out[k*16 + lane]` as f32, computing each
    /// value exactly as [`crate::quant::dequantize_row`] does.
    pub(crate) fn dequantize_tile_block(&self, tile: &[u8], b: usize, out: &mut [f32; QK * TILE_ROWS]) {
        let (qs, d, m) = self.offsets(b);
        match self.kind {
            PackedKind::Q4Min | PackedKind::Q4Off8 => {
                for lane in 0..TILE_ROWS {
                    let dl = f16_at(tile, d + lane * 2);
                    let ml = if self.kind == PackedKind::Q4Min { f16_at(tile, m + lane * 2) } else { 0.0 };
                    for j in 0..4 {
                        for i in 0..4 {
                            let byte = tile[qs + j * 64 + lane * 4 + i];
                            let (lo, hi) = ((byte & 0x0f) as i32, (byte >> 4) as i32);
                            let (k0, k1) = (4 * j + i, 16 + 4 * j + i);
                            if self.kind == PackedKind::Q4Min {
                                out[k0 * TILE_ROWS + lane] = lo as f32 * dl + ml;
                                out[k1 * TILE_ROWS + lane] = hi as f32 * dl + ml;
                            } else {
                                out[k0 * TILE_ROWS + lane] = (lo - 8) as f32 * dl;
                                out[k1 * TILE_ROWS + lane] = (hi - 8) as f32 * dl;
                            }
                        }
                    }
                }
            }
            PackedKind::Q8Off128 => {
                for lane in 0..TILE_ROWS {
                    let dl = f16_at(tile, d + lane * 2);
                    for g in 0..8 {
                        for i in 0..4 {
                            let q = (tile[qs + g * 64 + lane * 4 + i] ^ 0x80) as i8;
                            out[(4 * g + i) * TILE_ROWS + lane] = q as f32 * dl;
                        }
                    }
                }
            }
            PackedKind::F32 => {
                for (e, o) in out.iter_mut().enumerate() {
                    let at = qs + e * 4;
                    *o = f32::from_le_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
                }
            }
            PackedKind::F16 => {
                for (e, o) in out.iter_mut().enumerate() {
                    *o = f16_at(tile, qs + e * 2);
                }
            }
            PackedKind::BF16 => {
                for (e, o) in out.iter_mut().enumerate() {
                    let at = qs + e * 2;
                    *o = bf16::from_le_bytes([tile[at], tile[at + 1]]).to_f32();
                }
            }
        }
    }

    /// Dequantizes row `r` into `out` (length `cols`). Used for embedding lookups.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let tile = self.tile(r / TILE_ROWS);
        let lane = r % TILE_ROWS;
        let mut buf = [0f32; QK * TILE_ROWS];
        for b in 0..self.nb {
            self.dequantize_tile_block(tile, b, &mut buf);
            for k in 0..QK {
                out[b * QK + k] = buf[k * TILE_ROWS + lane];
            }
        }
    }

    /// Bytes the matrix occupies (what a pass over it streams from memory).
    pub fn n_bytes(&self) -> usize {
        self.data.len() * 64
    }
}

/// Converts an f32 slice to f16 values, for building float matrices in tests.
pub fn f32_to_f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect()
}
