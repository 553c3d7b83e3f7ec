//! Repacking ggml block-quantized matrices into the kernels' panel layout, at ggml's own size.
//!
//! Each supported type is decoded sub-block by sub-block into unsigned integer codes `q` and
//! the raw scale fields of its format, so that `w = d * q + m` with `d` and `m` rebuilt from
//! those fields by exactly the f32 operations ggml's dequantizer performs. Sixteen output rows
//! form a panel; inside a panel the codes of four consecutive `k` of all sixteen rows fill one
//! 64-byte vector (16 lanes of 4 bytes), the operand shape of VNNI's `vpdpbusd`.
//!
//! Storage per (panel, sub-block): the low 4 bits of the codes as nibbles (the low nibble holds
//! group 2i, the high nibble group 2i+1) — or whole bytes for Q8_0 — plus one 64-bit mask per
//! group for each higher bit (Q5_0: bit 4; Q6_K: bits 4 and 5), and the format's scales as
//! f16/u8 exactly as the file stores them. So a packed matrix is as large as the file's.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::PANEL;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

/// Static facts of one source type.
#[derive(Debug, Clone, Copy)]
pub struct Format {
    pub kind: Kind,
    pub dtype: GgmlDType,
    /// Elements per ggml block.
    pub block: usize,
    /// Bytes per ggml block.
    pub block_bytes: usize,
    /// Elements per sub-block (one scale pair): 32, or 16 for Q6_K.
    pub sub: usize,
    /// Sub-blocks sharing one f16 super-scale (K-quants; 1 otherwise).
    pub subs_per_super: usize,
    /// Bits above the low nibble, stored as masks (Q5_0: 1, Q6_K: 2).
    pub planes: usize,
    /// Codes stored as whole bytes (Q8_0).
    pub wide: bool,
}

/// The formats the kernels take; others stay on candle's kernels.
pub fn format_of(dtype: GgmlDType) -> Option<Format> {
    let f = |kind, block, block_bytes, sub, subs_per_super, planes, wide| Format {
        kind,
        dtype,
        block,
        block_bytes,
        sub,
        subs_per_super,
        planes,
        wide,
    };
    Some(match dtype {
        GgmlDType::Q4_0 => f(Kind::Q4_0, 32, 18, 32, 1, 0, false),
        GgmlDType::Q4_1 => f(Kind::Q4_1, 32, 20, 32, 1, 0, false),
        GgmlDType::Q5_0 => f(Kind::Q5_0, 32, 22, 32, 1, 1, false),
        GgmlDType::Q8_0 => f(Kind::Q8_0, 32, 34, 32, 1, 0, true),
        GgmlDType::Q4K => f(Kind::Q4K, 256, 144, 32, 8, 0, false),
        GgmlDType::Q6K => f(Kind::Q6K, 256, 210, 16, 16, 2, false),
        _ => return None,
    })
}

impl Format {
    /// Groups of four elements per sub-block.
    pub fn groups(&self) -> usize {
        self.sub / 4
    }

    /// Code bytes per (panel, sub-block).
    pub fn code_bytes(&self) -> usize {
        if self.wide {
            self.sub * PANEL
        } else {
            self.sub * PANEL / 2
        }
    }

    /// High-bit mask bytes per (panel, sub-block): one u64 per group and plane.
    pub fn plane_bytes(&self) -> usize {
        self.planes * self.groups() * 8
    }

    pub fn has_offset(&self) -> bool {
        matches!(self.kind, Kind::Q4_1 | Kind::Q4K)
    }

    pub fn has_sub_scale(&self) -> bool {
        matches!(self.kind, Kind::Q4K | Kind::Q6K)
    }

    /// Zero point of symmetric formats (`w = d * (q - zero)`).
    pub fn zero(&self) -> Option<i32> {
        match self.kind {
            Kind::Q4_0 => Some(8),
            Kind::Q5_0 => Some(16),
            Kind::Q8_0 => Some(128),
            Kind::Q6K => Some(32),
            Kind::Q4_1 | Kind::Q4K => None,
        }
    }
}

/// One decoded sub-block: codes and the raw scale fields it uses.
pub struct Sub {
    pub q: [u8; 32],
    /// Block scale (K-quants: super-block scale).
    pub scale: f16,
    /// Block offset (Q4_1 `m`; Q4_K super-block `dmin`).
    pub offset: f16,
    /// K-quant sub-block scale (Q6_K: an i8 stored as u8).
    pub sc: u8,
    /// Q4_K sub-block min.
    pub mn: u8,
}

/// `(d, m)` of a sub-block with `w = d * q + m`, by ggml's own f32 operations.
#[inline(always)]
pub fn scale_offset(kind: Kind, scale: f16, offset: f16, sc: u8, mn: u8) -> (f32, f32) {
    let d = scale.to_f32();
    match kind {
        Kind::Q4_0 => (d, -8.0 * d),
        Kind::Q5_0 => (d, -16.0 * d),
        Kind::Q8_0 => (d, -128.0 * d),
        Kind::Q4_1 => (d, offset.to_f32()),
        // ggml: d1 = d * sc; m1 = dmin * m; y = d1 * q - m1
        Kind::Q4K => (d * sc as f32, -(offset.to_f32() * mn as f32)),
        // ggml: y = d * sc * (q - 32), evaluated as (d * sc) * (q - 32)
        Kind::Q6K => {
            let d1 = d * (sc as i8) as f32;
            (d1, -32.0 * d1)
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// Decodes one ggml block into its sub-blocks, in element order.
pub fn decode_block(fmt: &Format, b: &[u8], out: &mut Vec<Sub>) {
    let zero = f16::ZERO;
    let mut q = [0u8; 32];
    match fmt.kind {
        Kind::Q4_0 => {
            for j in 0..16 {
                q[j] = b[2 + j] & 0xF;
                q[j + 16] = b[2 + j] >> 4;
            }
            out.push(Sub {
                q,
                scale: f16_at(b, 0),
                offset: zero,
                sc: 0,
                mn: 0,
            });
        }
        Kind::Q4_1 => {
            for j in 0..16 {
                q[j] = b[4 + j] & 0xF;
                q[j + 16] = b[4 + j] >> 4;
            }
            out.push(Sub {
                q,
                scale: f16_at(b, 0),
                offset: f16_at(b, 2),
                sc: 0,
                mn: 0,
            });
        }
        Kind::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                q[j] = (b[6 + j] & 0xF) | h0;
                q[j + 16] = (b[6 + j] >> 4) | h1;
            }
            out.push(Sub {
                q,
                scale: f16_at(b, 0),
                offset: zero,
                sc: 0,
                mn: 0,
            });
        }
        Kind::Q8_0 => {
            for j in 0..32 {
                q[j] = (b[2 + j] as i8 as i16 + 128) as u8;
            }
            out.push(Sub {
                q,
                scale: f16_at(b, 0),
                offset: zero,
                sc: 0,
                mn: 0,
            });
        }
        Kind::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, scales);
                let chunk = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
                for (t, &byte) in chunk.iter().enumerate() {
                    q[t] = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                }
                out.push(Sub {
                    q,
                    scale: d,
                    offset: dmin,
                    sc,
                    mn,
                });
            }
        }
        Kind::Q6K => {
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
            for (s, &scale) in sc.iter().enumerate() {
                let mut q = [0u8; 32];
                q[..16].copy_from_slice(&codes[16 * s..16 * s + 16]);
                out.push(Sub {
                    q,
                    scale: d,
                    offset: zero,
                    sc: scale,
                    mn: 0,
                });
            }
        }
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

/// Where code (row lane `r`, element `t`) of a sub-block lives: byte offset in the code bytes,
/// nibble shift, group (for the high-bit masks) and bit index in that group's masks.
#[derive(Debug, Clone, Copy)]
pub struct CodeSlot {
    pub byte: usize,
    pub shift: u32,
    pub group: usize,
    pub bit: usize,
}

#[inline(always)]
pub fn code_slot(wide: bool, r: usize, t: usize) -> CodeSlot {
    let (g, tt) = (t / 4, t % 4);
    let bit = r * 4 + tt;
    if wide {
        CodeSlot {
            byte: g * 64 + bit,
            shift: 0,
            group: g,
            bit,
        }
    } else {
        CodeSlot {
            byte: (g / 2) * 64 + bit,
            shift: if g % 2 == 0 { 0 } else { 4 },
            group: g,
            bit,
        }
    }
}
