//! [`StorageHints`]: what a store tells its callers about using it well.

/// What a store tells its callers about how to use it well
/// ([`Storage::hints`](crate::Storage::hints)). Values, not actions; a wrapper returns its
/// inner store's (or overrides one, as [`FaultStorage`](crate::FaultStorage) can for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StorageHints {
    /// How much of a file a caller that checks what it reads should ask this store to read
    /// ahead at once ([`Storage::prefetch`](crate::Storage::prefetch)): on local disk a
    /// window, itself read in calls small enough to check each in the CPU's cache; `None`
    /// (object stores, memory): everything in as few requests as possible.
    pub read_window: Option<u64>,
    /// The largest object this store writes in one request: a writer whose size hint is at
    /// most this sends one PUT, a larger one a multipart upload, which an object store must
    /// assemble on completion (some copy every byte again) and which leaves parts behind
    /// when abandoned. A caller that can spread its output over several objects keeps each
    /// within it. `None` (local disk, memory): any size is one write.
    pub object_bytes_max: Option<u64>,
    /// How many reads a caller gains from having in flight at once: several on an object
    /// store, where each is a request that waits for a round trip. `None` (local disk, which
    /// reads ahead; memory, where a read is a copy): one at a time, without threads.
    pub reads_in_flight: Option<usize>,
    /// Whether an inspected read shows the caller the store's own memory (a mapping of the
    /// file) rather than a copy: passing over bytes to inspect them, without copying them
    /// anywhere
    /// ([`ObjectReader::read_picked_inspected`](crate::ObjectReader::read_picked_inspected)),
    /// then costs no more than the CPU's pass over them. A caller that must check a whole
    /// stretch but keeps only parts of it reads the whole stretch on such a store, and only
    /// its parts elsewhere.
    pub reads_in_place: bool,
    /// How many files a writer gains from writing at once, and so about how many a large
    /// output is best cut into: several on local disk, whose writeback then runs on several
    /// files at once (measured: docs/benchmarks.md, "Decisions behind the constants").
    /// `None` (object stores, whose `object_bytes_max` cuts large output already; memory):
    /// nothing gained, one file is as good.
    pub writes_in_flight: Option<usize>,
}

impl StorageHints {
    /// No hints: no read window, any object size in one write, one read at a time, one file
    /// written at a time.
    pub const NONE: StorageHints = StorageHints {
        read_window: None,
        object_bytes_max: None,
        reads_in_flight: None,
        reads_in_place: false,
        writes_in_flight: None,
    };

    /// These hints with `read_window` replaced.
    pub fn with_read_window(self, read_window: Option<u64>) -> StorageHints {
        StorageHints { read_window, ..self }
    }

    /// These hints with `object_bytes_max` replaced.
    pub fn with_object_bytes_max(self, object_bytes_max: Option<u64>) -> StorageHints {
        StorageHints { object_bytes_max, ..self }
    }

    /// These hints with `reads_in_flight` replaced.
    pub fn with_reads_in_flight(self, reads_in_flight: Option<usize>) -> StorageHints {
        StorageHints { reads_in_flight, ..self }
    }

    /// These hints with `reads_in_place` replaced.
    pub fn with_reads_in_place(self, reads_in_place: bool) -> StorageHints {
        StorageHints { reads_in_place, ..self }
    }

    /// These hints with `writes_in_flight` replaced.
    pub fn with_writes_in_flight(self, writes_in_flight: Option<usize>) -> StorageHints {
        StorageHints { writes_in_flight, ..self }
    }
}
