//! dckpt-layout (placeholder)
