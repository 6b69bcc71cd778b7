//! dckpt-engine (placeholder)
