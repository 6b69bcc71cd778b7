//! The requests an S3 store sent, by kind: what the bucket bills and throttles by.

use std::sync::atomic::{AtomicU64, Ordering};

/// The HTTP requests an [`super::S3Storage`] sent, by kind ([`super::S3Storage::requests`]),
/// counted as each is sent, whatever its answer. The client's own retries of a failed request
/// are not counted again, and a listing counts one request whatever its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct S3Requests {
    /// PUTs of whole objects: puts, conditional creates and replaces, small writers.
    pub puts: u64,
    /// GETs: whole objects, each ranged read's spans, a conditional replace's read.
    pub gets: u64,
    /// HEADs (sizes).
    pub heads: u64,
    /// LISTs.
    pub lists: u64,
    /// DELETEs.
    pub deletes: u64,
    /// The requests of multipart uploads: each start, part, completion and abort.
    pub multipart: u64,
}

#[derive(Clone, Copy)]
pub(super) enum Request {
    Put,
    Get,
    Head,
    List,
    Delete,
    Multipart,
}

/// The live counts, shared by a store and its writers.
#[derive(Debug, Default)]
pub(super) struct Sent([AtomicU64; 6]);

impl Sent {
    pub(super) fn count(&self, r: Request) {
        self.0[r as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> S3Requests {
        let c = |r: Request| self.0[r as usize].load(Ordering::Relaxed);
        S3Requests {
            puts: c(Request::Put),
            gets: c(Request::Get),
            heads: c(Request::Head),
            lists: c(Request::List),
            deletes: c(Request::Delete),
            multipart: c(Request::Multipart),
        }
    }
}
