//! dckpt-collective (placeholder)
