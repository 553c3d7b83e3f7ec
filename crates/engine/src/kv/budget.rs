//! [`MemoryBudget`]: splits a byte budget (`--memory-budget`) into resident weights, a reserved
//! activation workspace and KV blocks, and reports what is in use.
//!
//! On CPU the budget models an accelerator's memory: the engine must fit weights + KV pool +
//! the temporaries of one step inside it, so batch sizes and footprints are real accounting.
//! The KV pool counts whole (used and free): it is allocated up front. A block counts what its
//! format stores ([`BlockLayout::block_bytes`]), so 8-bit blocks leave room for ~3.8x as many.

use switchyard_models::LayeredModel;
use switchyard_weights::ModelSpec;

use super::format::BlockLayout;
use super::pool::BlockPool;
use super::KvError;

const F32: usize = std::mem::size_of::<f32>();

/// Upper bound on the f32 temporaries of one forward step over `max_batched_tokens` tokens
/// that produces `logits_rows` rows of logits, in bytes.
///
/// Layers run one after another, so only one layer's temporaries are alive at once. With
/// `d = d_model`, `q = n_heads * head_dim`, `kv = n_kv_heads * head_dim`, `f = ffn_dim`,
/// `V = vocab_size`, `T = max_batched_tokens`, `R = logits_rows`:
///
/// ```text
/// bytes = 4 * ( T * ( 4d            hidden: residual in, normed input, block output, sum
///                   + 2(q + 2kv)    q, k, v as tensors and as host rows for rope/attention
///                   + 2q            attention output: per-task parts and the assembled rows
///                   + 3f )          MLP gate, up and gated product
///             + R * ( d + V ) )     normed rows and logits of the rows that need them
/// ```
///
/// Not counted: attention score rows (one per worker thread, at most `context_length` f32
/// each) and the 8-bit activation copies candle's quantized matmul makes (about a quarter of
/// the input they quantize); both are small next to the terms above.
pub fn activation_bytes(spec: &ModelSpec, max_batched_tokens: usize, logits_rows: usize) -> usize {
    let d = spec.d_model;
    let q = spec.n_heads * spec.head_dim;
    let kv = spec.n_kv_heads * spec.head_dim;
    let f = spec.ffn_dim;
    let per_token = 4 * d + 2 * (q + 2 * kv) + 2 * q + 3 * f;
    let per_logits_row = d + spec.vocab_size;
    F32 * (max_batched_tokens * per_token + logits_rows * per_logits_row)
}

/// How a budget is split: what is left after weights and workspace, in whole KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetPlan {
    pub total: u64,
    pub weights: u64,
    pub workspace: u64,
    pub block_bytes: u64,
    /// `(total - weights - workspace) / block_bytes`, at least 1.
    pub kv_blocks: usize,
}

impl BudgetPlan {
    pub fn kv_bytes(&self) -> u64 {
        self.kv_blocks as u64 * self.block_bytes
    }

    /// Bytes of the budget left over (less than one block).
    pub fn spare(&self) -> u64 {
        self.total - self.weights - self.workspace - self.kv_bytes()
    }
}

/// Memory in use, by category, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub weights: u64,
    /// KV blocks held by sequences or the prefix cache.
    pub kv_used: u64,
    /// KV blocks allocated and free.
    pub kv_free: u64,
    pub workspace: u64,
    pub total: u64,
}

impl Usage {
    /// The whole KV pool, used and free.
    pub fn kv_total(&self) -> u64 {
        self.kv_used + self.kv_free
    }

    /// Weights + KV pool + workspace.
    pub fn in_use(&self) -> u64 {
        self.weights + self.kv_total() + self.workspace
    }

    /// The invariant `weights + kv_total + workspace <= total`.
    pub fn check(&self) -> Result<(), KvError> {
        if self.in_use() > self.total {
            return Err(KvError::OverBudget {
                used: self.in_use(),
                weights: self.weights,
                kv: self.kv_total(),
                workspace: self.workspace,
                total: self.total,
            });
        }
        Ok(())
    }
}

/// The bytes the engine may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    pub total_bytes: u64,
}

impl MemoryBudget {
    pub fn new(total_bytes: u64) -> Self {
        Self { total_bytes }
    }

    /// A budget from a `--memory-budget` value (see [`parse_bytes`]).
    pub fn parse(s: &str) -> Result<Self, KvError> {
        parse_bytes(s).map(Self::new)
    }

    /// How many KV blocks of `block_bytes` fit beside `weights` and `workspace`; an error
    /// naming the shortfall when not even one does.
    pub fn plan(
        &self,
        weights: u64,
        workspace: u64,
        block_bytes: u64,
    ) -> Result<BudgetPlan, KvError> {
        let fixed = weights.saturating_add(workspace);
        let room = self.total_bytes.saturating_sub(fixed);
        let kv_blocks = room.checked_div(block_bytes).unwrap_or(0);
        if kv_blocks == 0 {
            return Err(KvError::BudgetTooSmall {
                total: self.total_bytes,
                weights,
                workspace,
                block_bytes,
                shortfall: fixed
                    .saturating_add(block_bytes.max(1))
                    .saturating_sub(self.total_bytes),
            });
        }
        Ok(BudgetPlan {
            total: self.total_bytes,
            weights,
            workspace,
            block_bytes,
            kv_blocks: usize::try_from(kv_blocks).unwrap_or(usize::MAX),
        })
    }

    /// [`MemoryBudget::plan`] for `model` as loaded now (its resident weights), blocks laid
    /// out as `blocks` (their format decides their bytes, see [`BlockLayout`]), and a
    /// workspace of [`activation_bytes`].
    pub fn plan_for_model(
        &self,
        model: &LayeredModel,
        blocks: BlockLayout,
        max_batched_tokens: usize,
        logits_rows: usize,
    ) -> Result<BudgetPlan, KvError> {
        self.plan(
            model.resident_bytes().total() as u64,
            activation_bytes(model.spec(), max_batched_tokens, logits_rows) as u64,
            blocks.block_bytes() as u64,
        )
    }

    /// Memory in use with `weights` resident, `pool` allocated and `workspace` reserved.
    pub fn usage(&self, weights: u64, pool: &BlockPool, workspace: u64) -> Usage {
        Usage {
            weights,
            kv_used: pool.bytes_used() as u64,
            kv_free: pool.bytes_free() as u64,
            workspace,
            total: self.total_bytes,
        }
    }
}

/// Parses a byte count: a plain number of bytes (`1000000`), or a number (fractions allowed)
/// with a unit: `B`, decimal `KB MB GB TB` (powers of 1000) or binary `KiB MiB GiB TiB`
/// (powers of 1024), case-insensitive, optionally separated by spaces. `2G` is refused as
/// ambiguous. A fraction of a byte is rounded down (`1.1KiB` = 1126).
pub fn parse_bytes(s: &str) -> Result<u64, KvError> {
    let bad = |reason| KvError::BadBytes {
        input: s.to_string(),
        reason,
    };
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() {
        return Err(bad(
            "expected a number of bytes, e.g. 2GiB, 512MiB, 1.5GB or 1000000",
        ));
    }
    if frac.contains('.') {
        return Err(bad("more than one decimal point"));
    }
    let mult: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "k" | "m" | "g" | "t" => {
            return Err(bad(
                "ambiguous unit: write KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024)",
            ))
        }
        _ => return Err(bad("unknown unit (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")),
    };
    // Integer arithmetic so large values stay exact: int * mult + frac * mult / 10^digits.
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse::<u64>().map_err(|_| bad("too large"))? as u128
    };
    // Digits past the 18th cannot change the result by a whole byte below 2^64.
    let frac = &frac[..frac.len().min(18)];
    let frac_value: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().map_err(|_| bad("bad fraction"))? as u128
    };
    let scale = 10u128.pow(frac.len() as u32);
    let bytes = int * mult + frac_value * mult / scale;
    u64::try_from(bytes).map_err(|_| bad("too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_weights::Architecture;

    #[test]
    fn parse_bytes_accepts_units_and_fractions() {
        let cases: [(&str, u64); 14] = [
            ("1000000", 1_000_000),
            ("2GiB", 2 << 30),
            ("512MiB", 512 << 20),
            ("1.5GB", 1_500_000_000),
            ("1.5 GiB", 3 << 29),
            ("  64 kib ", 65_536),
            ("10B", 10),
            ("0", 0),
            ("1TB", 1_000_000_000_000),
            ("1TiB", 1 << 40),
            (".5KB", 500),
            ("3.", 3),
            ("1.1KiB", 1126),
            ("18446744073709551615", u64::MAX),
        ];
        for (s, want) in cases {
            assert_eq!(parse_bytes(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn parse_bytes_rejects_bad_input() {
        for (s, reason) in [
            ("", "expected a number"),
            ("GiB", "expected a number"),
            ("-1GiB", "expected a number"),
            ("2G", "ambiguous"),
            ("2 XB", "unknown unit"),
            ("1.2.3MB", "more than one decimal point"),
            ("20000000000000000000", "too large"),
            ("17179869184GiB", "too large"),
            ("1e9", "unknown unit"),
        ] {
            match parse_bytes(s) {
                Err(KvError::BadBytes { input, reason: r }) => {
                    assert_eq!(input, s);
                    assert!(r.contains(reason), "{s:?}: {r}");
                }
                other => panic!("{s:?} gave {other:?}"),
            }
        }
        let msg = parse_bytes("2G").unwrap_err().to_string();
        assert!(msg.contains("\"2G\""), "{msg}");
    }

    fn smollm2_spec() -> ModelSpec {
        let mut spec = switchyard_weights::SyntheticSource::tiny_spec(Architecture::Llama);
        // smollm2-135m's shape
        spec.n_layers = 30;
        spec.d_model = 576;
        spec.n_heads = 9;
        spec.n_kv_heads = 3;
        spec.head_dim = 64;
        spec.ffn_dim = 1536;
        spec.vocab_size = 49_152;
        spec
    }

    #[test]
    fn activation_bytes_follows_the_formula() {
        let spec = smollm2_spec();
        // per token: 4*576 + 2*(576 + 2*192) + 2*576 + 3*1536 = 2304 + 1920 + 1152 + 4608
        assert_eq!(activation_bytes(&spec, 1, 0), 4 * 9984);
        // per logits row: 576 + 49152
        assert_eq!(activation_bytes(&spec, 0, 1), 4 * 49_728);
        assert_eq!(
            activation_bytes(&spec, 2048, 256),
            4 * (2048 * 9984 + 256 * 49_728)
        );
    }

    #[test]
    fn plan_counts_whole_blocks_and_names_the_shortfall() {
        let budget = MemoryBudget::parse("1MiB").expect("budget");
        let p = budget.plan(500_000, 100_000, 24_576).expect("plan");
        // (1048576 - 600000) / 24576 = 18.25
        assert_eq!(p.kv_blocks, 18);
        assert_eq!(p.kv_bytes(), 442_368);
        assert_eq!(p.spare(), 1_048_576 - 600_000 - 442_368);

        assert_eq!(
            budget.plan(1_000_000, 40_000, 24_576),
            Err(KvError::BudgetTooSmall {
                total: 1_048_576,
                weights: 1_000_000,
                workspace: 40_000,
                block_bytes: 24_576,
                shortfall: 1_040_000 + 24_576 - 1_048_576,
            })
        );
        let e = budget.plan(2_000_000, 0, 24_576).unwrap_err().to_string();
        assert!(e.contains("short by 976000 bytes"), "{e}");
        assert!(budget.plan(0, 0, 0).is_err());
    }

    #[test]
    fn usage_counts_the_whole_pool() {
        let budget = MemoryBudget::new(100_000);
        let mut pool = BlockPool::new(4, 16, 3); // 512-byte blocks
        let b = pool.allocate().expect("block");
        let u = budget.usage(50_000, &pool, 10_000);
        assert_eq!((u.kv_used, u.kv_free, u.kv_total()), (512, 1024, 1536));
        assert_eq!(u.in_use(), 61_536);
        assert_eq!(u.check(), Ok(()));
        let over = MemoryBudget::new(61_535).usage(50_000, &pool, 10_000);
        assert!(matches!(
            over.check(),
            Err(KvError::OverBudget { used: 61_536, .. })
        ));
        pool.release(b);
    }
}
