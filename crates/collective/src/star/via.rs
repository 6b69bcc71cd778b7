//! The `Collective` implementation every star backend shares, as a macro over its `star`
//! field.

/// Implements [`crate::Collective`] for a backend type whose `star` field runs the calls.
macro_rules! collective_via_star {
    ($t:ty) => {
        impl $crate::Collective for $t {
            fn rank(&self) -> usize {
                self.star.rank()
            }
            fn world_size(&self) -> usize {
                self.star.world_size()
            }
            fn barrier(&self) -> $crate::Result<()> {
                self.star.barrier()
            }
            fn broadcast(&self, root: usize, data: Option<&[u8]>) -> $crate::Result<Vec<u8>> {
                self.star.broadcast(root, data)
            }
            fn gather(&self, root: usize, data: Vec<u8>) -> $crate::Result<Option<Vec<Vec<u8>>>> {
                self.star.gather(root, data)
            }
            fn all_gather(&self, data: Vec<u8>) -> $crate::Result<Vec<Vec<u8>>> {
                self.star.all_gather(data)
            }
            fn all_reduce_u64(&self, values: &[u64], op: $crate::ReduceOp) -> $crate::Result<Vec<u64>> {
                self.star.all_reduce_u64(values, op)
            }
            fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> $crate::Result<Vec<u8>> {
                self.star.scatter(root, parts)
            }
            fn exchange(
                &self,
                sends: Vec<(usize, ::bytes::Bytes)>,
                from: &[usize],
            ) -> $crate::Result<Vec<::bytes::Bytes>> {
                self.star.exchange(sends, from)
            }
        }

        impl $t {
            /// Payload bytes of all messages this rank has received so far, from every peer
            /// and call (framing and the rendezvous not included): what the calls cost this
            /// rank on the wire. Every call goes through rank 0, so rank 0 receives each
            /// rank's contribution, and a rank other than 0 receives only what rank 0 sends it.
            pub fn bytes_received(&self) -> u64 {
                self.star.bytes_received()
            }
        }
    };
}
pub(crate) use collective_via_star;
