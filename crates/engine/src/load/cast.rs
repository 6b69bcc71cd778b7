//! Requests loaded as another dtype than the one stored: read, and checked, into a buffer of
//! the stored dtype, then cast into the caller's buffer once every read is done.

use dckpt_shard_spec::DType;
use dckpt_shard_spec::cast::{can_cast, cast_into};

use super::LoadRequest;
use crate::{Error, Result};

/// One buffer of the stored dtype for each request the plan casts.
pub(super) struct CastBuffers {
    /// Request index, stored dtype, the region's elements in it; in request order.
    bufs: Vec<(usize, DType, Vec<u8>)>,
}

impl CastBuffers {
    /// A buffer for each of `casts`, or none and the failure, where a plan garbled on the
    /// way names a request it cannot cast.
    pub(super) fn new(casts: &[(u32, DType)], req: &LoadRequest<'_>) -> (CastBuffers, Result<()>) {
        let mut bufs = Vec::with_capacity(casts.len());
        for &(ri, from) in casts {
            let (ri, last) = (ri as usize, bufs.last().map(|b: &(usize, DType, Vec<u8>)| b.0));
            match req.tensors.get(ri) {
                Some(r) if can_cast(from, r.tensor.dtype) && last.is_none_or(|l| l < ri) => {
                    let numel = r.data.len() / r.tensor.dtype.size() as usize;
                    bufs.push((ri, from, vec![0; numel * from.size() as usize]));
                }
                _ => {
                    return (
                        CastBuffers { bufs: Vec::new() },
                        Err(Error::protocol("a cast of a request it cannot cast")),
                    );
                }
            }
        }
        (CastBuffers { bufs }, Ok(()))
    }

    /// Where each request's and object's bytes are read to: its own buffer, or its buffer of
    /// the stored dtype.
    pub(super) fn dests<'b>(&'b mut self, req: &'b mut LoadRequest<'_>) -> Vec<&'b mut [u8]> {
        let mut staged = self.bufs.iter_mut().peekable();
        req.tensors
            .iter_mut()
            .enumerate()
            .map(|(i, r)| match staged.next_if(|b| b.0 == i) {
                Some(b) => &mut b.2[..],
                None => &mut *r.data,
            })
            .chain(req.objects.iter_mut().map(|o| o.data.as_deref_mut().unwrap_or(&mut [])))
            .collect()
    }

    /// Each buffer cast into its request's.
    pub(super) fn finish(self, req: &mut LoadRequest<'_>) {
        for (ri, from, buf) in self.bufs {
            let r = &mut req.tensors[ri];
            cast_into(from, r.tensor.dtype, &buf, r.data);
        }
    }
}
