//! Repacking ggml block-quantized matrices into the kernels' panel layout.
//!
//! Every supported type is decoded, sub-block by sub-block, into unsigned integer codes `q`
//! with one scale `d` and one offset `m` per (row, sub-block) so that `w = d * q + m`. Sixteen
//! output rows form a panel; inside a panel the codes of four consecutive `k` of all sixteen
//! rows fill one 64-byte vector (16 lanes of 4 bytes), the operand shape of VNNI's `vpdpbusd`.
//! 4-bit codes are stored two per byte (the low nibble holds group 2i, the high nibble group
//! 2i+1); wider codes one per byte.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::PANEL;

/// How a (row, sub-block) is reconstructed exactly as ggml does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recon {
    /// `d * (q - zero)` (Q4_0, Q5_0, Q8_0, Q6_K).
    Symmetric { zero: u8 },
    /// `d * q + m` (Q4_1, Q4_K).
    Affine,
}

/// Static facts of one source type.
#[derive(Debug, Clone, Copy)]
pub struct Format {
    pub dtype: GgmlDType,
    /// Elements per ggml block.
    pub block: usize,
    /// Bytes per ggml block.
    pub block_bytes: usize,
    /// Elements per sub-block (one scale/offset pair): 32, or 16 for Q6_K.
    pub sub: usize,
    /// Codes fit in 4 bits.
    pub nibbles: bool,
    pub recon: Recon,
}

/// The formats the kernels take; others stay on candle's kernels.
pub fn format_of(dtype: GgmlDType) -> Option<Format> {
    let f = |block, block_bytes, sub, nibbles, recon| Format {
        dtype,
        block,
        block_bytes,
        sub,
        nibbles,
        recon,
    };
    Some(match dtype {
        GgmlDType::Q4_0 => f(32, 18, 32, true, Recon::Symmetric { zero: 8 }),
        GgmlDType::Q4_1 => f(32, 20, 32, true, Recon::Affine),
        GgmlDType::Q5_0 => f(32, 22, 32, false, Recon::Symmetric { zero: 16 }),
        GgmlDType::Q8_0 => f(32, 34, 32, false, Recon::Symmetric { zero: 128 }),
        GgmlDType::Q4K => f(256, 144, 32, true, Recon::Affine),
        GgmlDType::Q6K => f(256, 210, 16, false, Recon::Symmetric { zero: 32 }),
        _ => return None,
    })
}

/// One decoded sub-block: codes, scale, offset.
pub struct Sub {
    pub q: [u8; 32],
    pub d: f32,
    pub m: f32,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes one ggml block into its sub-blocks, in element order.
pub fn decode_block(fmt: &Format, b: &[u8], out: &mut Vec<Sub>) {
    let mut q = [0u8; 32];
    match fmt.dtype {
        GgmlDType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                q[j] = b[2 + j] & 0xF;
                q[j + 16] = b[2 + j] >> 4;
            }
            out.push(Sub { q, d, m: -8.0 * d });
        }
        GgmlDType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                q[j] = b[4 + j] & 0xF;
                q[j + 16] = b[4 + j] >> 4;
            }
            out.push(Sub { q, d, m });
        }
        GgmlDType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                q[j] = (b[6 + j] & 0xF) | h0;
                q[j + 16] = (b[6 + j] >> 4) | h1;
            }
            out.push(Sub { q, d, m: -16.0 * d });
        }
        GgmlDType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                q[j] = (b[2 + j] as i8 as i16 + 128) as u8;
            }
            out.push(Sub {
                q,
                d,
                m: -128.0 * d,
            });
        }
        GgmlDType::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, scales);
                // ggml: d1 = d * sc; m1 = min * m; y = d1 * q - m1
                let d1 = d * sc as f32;
                let m1 = dmin * mn as f32;
                let chunk = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
                for (t, &byte) in chunk.iter().enumerate() {
                    q[t] = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                }
                out.push(Sub { q, d: d1, m: -m1 });
            }
        }
        GgmlDType::Q6K => {
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_at(b, 208);
            let mut codes = [0u8; 256];
            for half in 0..2 {
                let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                let y = &mut codes[128 * half..];
                for l in 0..32 {
                    y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for s in 0..16 {
                // ggml: y = d * sc * (q - 32), evaluated as (d * sc) * (q - 32)
                let d1 = d * (sc[s] as i8) as f32;
                let mut q = [0u8; 32];
                q[..16].copy_from_slice(&codes[16 * s..16 * s + 16]);
                out.push(Sub {
                    q,
                    d: d1,
                    m: -32.0 * d1,
                });
            }
        }
        _ => {}
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a Q4_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Bytes of codes per (panel, sub-block).
pub fn code_bytes(fmt: &Format) -> usize {
    if fmt.nibbles {
        fmt.sub * PANEL / 2
    } else {
        fmt.sub * PANEL
    }
}

/// Byte offset and nibble shift of code (row lane `r`, element `t`) inside a panel sub-block.
#[inline(always)]
pub fn code_position(nibbles: bool, r: usize, t: usize) -> (usize, u32) {
    let (g, tt) = (t / 4, t % 4);
    if nibbles {
        ((g / 2) * 64 + r * 4 + tt, if g % 2 == 0 { 0 } else { 4 })
    } else {
        (g * 64 + r * 4 + tt, 0)
    }
}
