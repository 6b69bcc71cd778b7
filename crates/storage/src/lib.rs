//! dckpt-storage (placeholder)
