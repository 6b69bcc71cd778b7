//! dckpt-shard-spec (placeholder)
