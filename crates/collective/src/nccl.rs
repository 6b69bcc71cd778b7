//! NCCL backend (feature `nccl`).
