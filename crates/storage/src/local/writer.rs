//! Streaming writes of one object: positional writes from a small pool of threads.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;

use super::sys::*;
use super::*;
use crate::{Error, ObjectWriter, Result};

/// A block on its way to disk.
pub(super) enum Block {
    Owned(Vec<u8>),
    Shared(Bytes),
}

impl Block {
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Block::Owned(v) => v,
            Block::Shared(b) => b,
        }
    }
}

/// Positional writers on a few threads. Memory: at most `threads + 2` owned blocks exist
/// (recycled through `free_rx`), and at most `threads` shared blocks wait in the queue.
/// A pool with no thread (none asked for, or none the process could start) writes each
/// block on the calling thread as it is submitted.
pub(super) struct WritePool {
    pub(super) work_tx: Option<SyncSender<(u64, Block)>>,
    pub(super) free_rx: Receiver<Vec<u8>>,
    pub(super) workers: Vec<JoinHandle<()>>,
    pub(super) error: Arc<Mutex<Option<io::Error>>>,
    pub(super) owned_blocks: usize,
    /// Without workers: the file, and where written blocks go back to `free_rx`.
    pub(super) inline: Option<(Arc<File>, Sender<Vec<u8>>)>,
}

/// Writes one block unless an earlier one failed (the first error is kept), then hands an
/// owned block's buffer back for reuse.
fn write_block(file: &File, offset: u64, block: Block, error: &Mutex<Option<io::Error>>, free_tx: &Sender<Vec<u8>>) {
    let failed = error.lock().unwrap_or_else(|p| p.into_inner()).is_some();
    if !failed {
        match file.write_all_at(block.as_slice(), offset) {
            Ok(()) => start_writeback(file, offset, block.as_slice().len()),
            Err(e) => {
                error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
            }
        }
    }
    if let Block::Owned(mut v) = block {
        v.clear();
        let _ = free_tx.send(v);
    }
}

impl WritePool {
    pub(super) fn new(file: Arc<File>, threads: usize) -> WritePool {
        let (work_tx, work_rx) = mpsc::sync_channel::<(u64, Block)>(threads);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        let work_rx = Arc::new(Mutex::new(work_rx));
        let error: Arc<Mutex<Option<io::Error>>> = Arc::default();
        // As many as start: a process at its thread limit gets fewer, or none.
        let workers: Vec<JoinHandle<()>> = (0..threads)
            .map_while(|_| {
                let (file, work_rx, free_tx, error) = (file.clone(), work_rx.clone(), free_tx.clone(), error.clone());
                let work = move || loop {
                    let next = work_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((offset, block)) = next else { break };
                    write_block(&file, offset, block, &error, &free_tx);
                };
                std::thread::Builder::new().name("dckpt-write".into()).spawn(work).ok()
            })
            .collect();
        let inline = workers.is_empty().then_some((file, free_tx));
        WritePool { work_tx: Some(work_tx), free_rx, workers, error, owned_blocks: 0, inline }
    }

    pub(super) fn take_error(&self) -> Option<io::Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    pub(super) fn submit(&mut self, offset: u64, block: Block) -> io::Result<()> {
        if let Some(e) = self.take_error() {
            return Err(e);
        }
        if let Some((file, free_tx)) = &self.inline {
            write_block(file, offset, block, &self.error, free_tx);
            return self.take_error().map_or(Ok(()), Err);
        }
        let tx = self.work_tx.as_ref().ok_or_else(|| io::Error::other("write pool closed"))?;
        tx.send((offset, block)).map_err(|_| io::Error::other("write threads stopped"))
    }

    /// An empty block buffer: a recycled one, a new one while under `max`, else waits.
    pub(super) fn buffer(&mut self, max: usize, block_bytes: usize) -> io::Result<Vec<u8>> {
        if let Ok(v) = self.free_rx.try_recv() {
            return Ok(v);
        }
        if self.owned_blocks < max {
            self.owned_blocks += 1;
            return Ok(Vec::with_capacity(block_bytes));
        }
        self.free_rx.recv().map_err(|_| io::Error::other("write threads stopped"))
    }

    /// Waits for every queued write; returns the first error.
    pub(super) fn close(&mut self) -> io::Result<()> {
        self.work_tx = None;
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                return Err(io::Error::other("write thread panicked"));
            }
        }
        self.take_error().map_or(Ok(()), Err)
    }
}

pub(super) struct LocalWriter {
    pub(super) file: Arc<File>,
    pub(super) tmp: PathBuf,
    pub(super) target: PathBuf,
    pub(super) location: String,
    pub(super) threads: usize,
    pub(super) block_bytes: usize,
    pub(super) buf: Vec<u8>,
    /// Bytes handed to the pool (or written) so far; `buf` starts here.
    pub(super) offset: u64,
    pub(super) pool: Option<WritePool>,
    pub(super) failed: bool,
    pub(super) done: bool,
}

impl std::fmt::Debug for LocalWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWriter").field("location", &self.location).field("offset", &self.offset).finish()
    }
}

impl LocalWriter {
    pub(super) fn new(file: File, tmp: PathBuf, target: PathBuf, location: String, config: &LocalConfig) -> Self {
        LocalWriter {
            file: Arc::new(file),
            tmp,
            target,
            location,
            threads: config.write_threads,
            block_bytes: config.block_bytes,
            buf: Vec::new(),
            offset: 0,
            pool: None,
            failed: false,
            done: false,
        }
    }

    pub(super) fn pool(&mut self) -> &mut WritePool {
        let (file, threads) = (&self.file, self.threads);
        self.pool.get_or_insert_with(|| WritePool::new(file.clone(), threads))
    }

    /// Sends the full buffer to the pool and takes an empty one.
    pub(super) fn flush_block(&mut self) -> io::Result<()> {
        let (max, block_bytes) = (self.threads + 2, self.block_bytes);
        let fresh = self.pool().buffer(max, block_bytes)?;
        let full = std::mem::replace(&mut self.buf, fresh);
        let n = full.len() as u64;
        let offset = self.offset;
        self.pool().submit(offset, Block::Owned(full))?;
        self.offset += n;
        Ok(())
    }

    pub(super) fn append(&mut self, mut data: &[u8]) -> io::Result<()> {
        if data.len() >= self.block_bytes {
            return self.write_in_place(&[data]);
        }
        while !data.is_empty() {
            if self.buf.capacity() == 0 {
                // The first block grows as needed, so a small object spawns no threads.
                let (max, block_bytes) = (self.threads + 2, self.block_bytes);
                if let Some(pool) = self.pool.as_mut() {
                    self.buf = pool.buffer(max, block_bytes)?;
                }
            }
            let room = self.block_bytes - self.buf.len();
            let (now, rest) = data.split_at(room.min(data.len()));
            self.buf.extend_from_slice(now);
            data = rest;
            if self.buf.len() == self.block_bytes {
                self.flush_block()?;
            }
        }
        Ok(())
    }

    /// Pieces adding up to at least [`VECTORED_IN_PLACE_BYTES`] are written straight from
    /// the caller's memory; fewer bytes are buffered like single writes.
    pub(super) fn append_vectored(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        if bufs.iter().map(|b| b.len()).sum::<usize>() >= VECTORED_IN_PLACE_BYTES.min(self.block_bytes) {
            return self.write_in_place(bufs);
        }
        bufs.iter().try_for_each(|b| self.append(b))
    }

    /// Writes large borrowed pieces from the calling thread, without copying them (one
    /// vectored write): the buffered bytes before them go to the pool first (positional
    /// writes need no order).
    pub(super) fn write_in_place(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        if !self.buf.is_empty() {
            let partial = std::mem::take(&mut self.buf);
            let (offset, n) = (self.offset, partial.len() as u64);
            self.pool().submit(offset, Block::Owned(partial))?;
            self.offset += n;
        }
        if let Some(e) = self.pool.as_ref().and_then(WritePool::take_error) {
            return Err(e);
        }
        pwritev_all(&self.file, bufs, self.offset)?;
        let n = bufs.iter().map(|b| b.len()).sum::<usize>();
        start_writeback(&self.file, self.offset, n);
        self.offset += n as u64;
        Ok(())
    }

    pub(super) fn append_bytes(&mut self, data: Bytes) -> io::Result<()> {
        if !self.buf.is_empty() || data.len() < self.block_bytes {
            return self.append(&data);
        }
        let (offset, n) = (self.offset, data.len() as u64);
        self.pool().submit(offset, Block::Shared(data))?;
        self.offset += n;
        Ok(())
    }

    /// Runs one write operation unless the writer already failed; a failure poisons it.
    pub(super) fn guard(&mut self, op: impl FnOnce(&mut Self) -> io::Result<()>) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        op(self).map_err(|e| {
            self.failed = true;
            Error::io("write", &self.location, e)
        })
    }

    pub(super) fn complete(&mut self) -> io::Result<u64> {
        let tail = std::mem::take(&mut self.buf);
        let total = self.offset + tail.len() as u64;
        if let Some(pool) = self.pool.as_mut() {
            if !tail.is_empty() {
                pool.submit(self.offset, Block::Owned(tail))?;
            }
            pool.close()?;
        } else {
            self.file.write_all_at(&tail, self.offset)?;
        }
        self.file.sync_all()?;
        // Without the directory's lock (the storage contract, item 2).
        publish(&self.tmp, &self.target)?;
        Ok(total)
    }

    pub(super) fn cleanup(&mut self) -> io::Result<()> {
        self.done = true;
        if let Some(pool) = self.pool.as_mut() {
            let _ = pool.close();
        }
        match fs::remove_file(&self.tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

impl ObjectWriter for LocalWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.guard(|w| w.append(data))
    }

    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        self.guard(|w| w.append_bytes(data))
    }

    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        self.guard(|w| w.append_vectored(bufs))
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        if self.failed {
            let _ = self.cleanup();
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        match self.complete() {
            Ok(n) => {
                self.done = true;
                Ok(n)
            }
            Err(e) => {
                let _ = self.cleanup();
                Err(Error::io("finish", &self.location, e))
            }
        }
    }

    fn abort(mut self: Box<Self>) -> Result<()> {
        self.cleanup().map_err(|e| Error::io("abort", &self.location, e))
    }
}

impl Drop for LocalWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cleanup();
        }
    }
}
