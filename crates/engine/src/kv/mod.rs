//! Paged KV cache: block pool, per-sequence block tables, prefix cache, memory budget.
