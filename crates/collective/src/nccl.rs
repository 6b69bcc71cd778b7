//! NCCL on GPUs (feature `nccl`), through `cudarc` with libraries loaded at run time.
//!
//! Byte messages are staged through device buffers: lengths first (an all-gather of one
//! `u64` per rank), then the bytes padded to the longest message, so variable sizes and
//! empty messages work with NCCL's fixed-count calls. NCCL has no gather, so `gather` is
//! an all-gather whose result only the root keeps (fine for one GPU per rank on a node;
//! a send/recv version is future work).
//!
//! Bounds: each call polls its completion event until the timeout, then fails with
//! [`Error::Gpu`] and poisons the instance (dropping it aborts the communicator). NCCL
//! does not report a dead peer by itself, so on this backend a dead peer shows as that
//! timeout, not at once. `ncclCommInitRank` itself is not bounded (NCCL waits for every
//! rank); the rendezvous before it is.
//!
//! One thread per communicator: the communicator is only ever used under this
//! instance's lock, from whichever thread holds it.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::{Comm, Id};

use crate::{Collective, CollectiveExt, CollectiveOptions, Error, ReduceOp, Result, TcpCollective, TcpOptions};

/// Which shared libraries were found (file names as given to `dlopen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclLibraries {
    /// The CUDA driver library that loaded (`libcuda.so.1` or `libcuda.so`).
    pub cuda: String,
    /// The NCCL library that loaded (`libnccl.so`, the name cudarc looks for).
    pub nccl: String,
}

const CUDA_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];
const CUDA_SYMBOLS: [&str; 3] = ["cuInit", "cuDeviceGetCount", "cuDevicePrimaryCtxRetain"];
const NCCL_SYMBOLS: [&str; 11] = [
    "ncclGetUniqueId",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclCommInitRank",
    "ncclCommAbort",
    "ncclBroadcast",
    "ncclAllGather",
    "ncclAllReduce",
    "ncclGetVersion",
];

/// Checks that the CUDA driver and NCCL can be loaded, and have the symbols this backend
/// calls, before cudarc (which panics on a missing library) is touched.
///
/// cudarc looks for `libnccl.so`, while the `nvidia-nccl` wheels ship only `libnccl.so.2`:
/// when only the latter is found the error says so (put a `libnccl.so` symlink on
/// `LD_LIBRARY_PATH`, as `scripts/gpu-check.sh` does).
pub fn probe_libraries() -> Result<NcclLibraries> {
    let cuda = probe(&CUDA_NAMES, &CUDA_SYMBOLS)?;
    let nccl = match probe(&["libnccl.so"], &NCCL_SYMBOLS) {
        Ok(name) => name,
        Err(e) => {
            if probe(&["libnccl.so.2"], &[]).is_ok() {
                return Err(Error::Gpu {
                    detail: "libnccl.so.2 loads but libnccl.so (the name cudarc loads) does not: \
                             put a symlink named libnccl.so to it on LD_LIBRARY_PATH"
                        .into(),
                });
            }
            return Err(e);
        }
    };
    Ok(NcclLibraries { cuda, nccl })
}

/// The first of `names` that loads and has every symbol.
fn probe(names: &[&str], symbols: &[&str]) -> Result<String> {
    let mut tried = Vec::new();
    for name in names {
        // SAFETY: loading the CUDA/NCCL libraries runs their initialisers, which is what
        // cudarc would do next anyway; nothing is called through the handle here.
        match unsafe { libloading::Library::new(*name) } {
            Ok(lib) => {
                for sym in symbols {
                    // SAFETY: only the symbol's presence is checked; it is never called.
                    if unsafe { lib.get::<*const ()>(sym.as_bytes()) }.is_err() {
                        return Err(Error::Gpu { detail: format!("{name} lacks symbol {sym}") });
                    }
                }
                return Ok((*name).to_string());
            }
            Err(e) => {
                let why = std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
                tried.push(format!("{name}: {e} {why}"));
            }
        }
    }
    Err(Error::Gpu { detail: format!("cannot load any of {names:?} ({})", tried.join("; ")) })
}

/// One rank of an NCCL world: one GPU, one communicator.
pub struct NcclCollective {
    rank: usize,
    world: usize,
    opts: CollectiveOptions,
    libraries: NcclLibraries,
    inner: Mutex<Inner>,
    /// The world the NCCL id travelled through; kept so the job stays whole.
    _bootstrap: Option<Box<dyn Collective>>,
}

struct Inner {
    comm: SendComm,
    stream: Arc<CudaStream>,
    poisoned: Option<String>,
}

struct SendComm(Comm);

// SAFETY: an NCCL communicator may be driven from any thread as long as calls on it are not
// concurrent; `Inner` is only reachable through a Mutex, so one thread at a time uses it.
unsafe impl Send for SendComm {}

impl fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("libraries", &self.libraries)
            .finish_non_exhaustive()
    }
}

impl NcclCollective {
    /// Torchrun's environment: a [`TcpCollective::from_env`] world ships the NCCL id, and
    /// the GPU is `LOCAL_RANK`.
    pub fn from_env() -> Result<NcclCollective> {
        let opts = TcpOptions::from_env()?;
        let local_rank = crate::tcp::TcpConfig::from_env()?.local_rank;
        let bootstrap = TcpCollective::from_env()?;
        Self::with_bootstrap(Box::new(bootstrap), local_rank, &opts.collective)
    }

    /// Builds the communicator on GPU `device`, with rank and world taken from `bootstrap`,
    /// which carries the 128-byte NCCL id from rank 0 and is kept alive with the result.
    /// Every rank first agrees that its libraries and GPU are usable, so a rank without
    /// them makes every rank fail instead of leaving the others waiting.
    pub fn with_bootstrap(bootstrap: Box<dyn Collective>, device: usize, opts: &CollectiveOptions) -> Result<Self> {
        let mut c = Self::new(bootstrap.as_ref(), device, opts)?;
        c._bootstrap = Some(bootstrap);
        Ok(c)
    }

    /// As [`NcclCollective::with_bootstrap`], borrowing the bootstrap world.
    pub fn new(bootstrap: &dyn Collective, device: usize, opts: &CollectiveOptions) -> Result<Self> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let local = probe_libraries().and_then(|libs| Ok((libs, open_device(device)?)));
        if !bootstrap.all_succeeded(local.is_ok())? {
            return Err(local
                .err()
                .unwrap_or_else(|| Error::Gpu { detail: "another rank has no usable GPU/NCCL".into() }));
        }
        let (libraries, stream) = local?;
        let id = share_id(bootstrap)?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(|e| gpu("ncclCommInitRank", e))?;
        let inner = Inner { comm: SendComm(comm), stream, poisoned: None };
        Ok(NcclCollective { rank, world, opts: opts.clone(), libraries, inner: Mutex::new(inner), _bootstrap: None })
    }

    /// The libraries this backend loaded.
    pub fn libraries(&self) -> &NcclLibraries {
        &self.libraries
    }

    fn call<T>(&self, op: &'static str, body: impl FnOnce(&Self, &mut Inner) -> Result<T>) -> Result<T> {
        let mut inner = self.inner.lock().map_err(|_| Error::Poisoned { cause: "a previous call panicked".into() })?;
        if let Some(cause) = &inner.poisoned {
            return Err(Error::Poisoned { cause: cause.clone() });
        }
        let result = body(self, &mut inner);
        if let Err(e) = &result {
            inner.poisoned = Some(format!("{op}: {e}"));
        }
        result
    }

    /// Waits for the stream's work, up to the timeout.
    fn wait(&self, inner: &Inner, op: &'static str) -> Result<()> {
        let event = inner.stream.record_event(None).map_err(|e| gpu("recording an event", e))?;
        let deadline = crate::deadline_after(self.opts.timeout);
        let mut pause = Duration::from_micros(20);
        loop {
            // SAFETY: the event is alive for the duration of the call.
            match unsafe { cudarc::driver::result::event::query(event.cu_event()) } {
                Ok(()) => return Ok(()),
                Err(DriverError(cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {}
                Err(e) => return Err(gpu(op, e)),
            }
            if Instant::now() >= deadline {
                let detail = format!(
                    "{op} did not complete within {:?}: a peer died or hangs (NCCL names no rank); \
                     drop this instance to abort the communicator",
                    self.opts.timeout
                );
                return Err(Error::Gpu { detail });
            }
            thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    fn upload(&self, inner: &Inner, data: &[u64]) -> Result<CudaSlice<u64>> {
        inner.stream.clone_htod(data).map_err(|e| gpu("copy to device", e))
    }

    fn upload_bytes(&self, inner: &Inner, data: &[u8], len: usize) -> Result<CudaSlice<u8>> {
        let mut buf = inner.stream.alloc_zeros::<u8>(len.max(1)).map_err(|e| gpu("device alloc", e))?;
        if !data.is_empty() {
            inner.stream.memcpy_htod(data, &mut buf).map_err(|e| gpu("copy to device", e))?;
        }
        Ok(buf)
    }

    fn all_gather_u64(&self, inner: &Inner, value: u64, op: &'static str) -> Result<Vec<u64>> {
        let send = self.upload(inner, &[value])?;
        let mut recv = inner.stream.alloc_zeros::<u64>(self.world).map_err(|e| gpu("device alloc", e))?;
        inner.comm.0.all_gather(&send, &mut recv).map_err(|e| gpu(op, e))?;
        self.wait(inner, op)?;
        inner.stream.clone_dtoh(&recv).map_err(|e| gpu("copy from device", e))
    }

    fn check_len(&self, rank: usize, len: u64) -> Result<()> {
        if len > self.opts.message_bytes_max {
            return Err(Error::MessageTooLarge { rank, bytes: len, bytes_max: self.opts.message_bytes_max });
        }
        Ok(())
    }

    fn all_gather_bytes(&self, inner: &Inner, data: &[u8], op: &'static str) -> Result<Vec<Vec<u8>>> {
        let lens = self.all_gather_u64(inner, data.len() as u64, op)?;
        for (r, len) in lens.iter().enumerate() {
            self.check_len(r, *len)?;
        }
        let width = lens.iter().copied().max().unwrap_or(0) as usize;
        let send = self.upload_bytes(inner, data, width)?;
        let mut recv = inner.stream.alloc_zeros::<u8>(width.max(1) * self.world).map_err(|e| gpu("device alloc", e))?;
        inner.comm.0.all_gather(&send, &mut recv).map_err(|e| gpu(op, e))?;
        self.wait(inner, op)?;
        let all = inner.stream.clone_dtoh(&recv).map_err(|e| gpu("copy from device", e))?;
        let parts = all.chunks(width.max(1)).zip(&lens).map(|(chunk, len)| chunk[..*len as usize].to_vec());
        Ok(parts.collect())
    }

    fn broadcast_body(&self, inner: &Inner, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(Error::invalid(format!("root {root} out of world of {}", self.world)));
        }
        let data = match (self.rank == root, data) {
            (true, Some(d)) => d,
            (true, None) => return Err(Error::invalid(format!("broadcast root {root} passed no data"))),
            (false, _) => &[],
        };
        self.check_len(self.rank, data.len() as u64)?;
        let mut len = self.upload(inner, &[data.len() as u64])?;
        inner.comm.0.broadcast_in_place(&mut len, root as i32).map_err(|e| gpu(OP, e))?;
        self.wait(inner, OP)?;
        let len = inner.stream.clone_dtoh(&len).map_err(|e| gpu("copy from device", e))?.first().copied().unwrap_or(0);
        self.check_len(root, len)?;
        let mut buf = self.upload_bytes(inner, data, len as usize)?;
        inner.comm.0.broadcast_in_place(&mut buf, root as i32).map_err(|e| gpu(OP, e))?;
        self.wait(inner, OP)?;
        let mut out = inner.stream.clone_dtoh(&buf).map_err(|e| gpu("copy from device", e))?;
        out.truncate(len as usize);
        Ok(out)
    }

    /// Point to point with `ncclSend` / `ncclRecv`: one group of the lengths (a `u64` per
    /// message), then one group of the bytes (at least one byte each, as NCCL wants a
    /// count); operations on one peer match in the order they are issued.
    fn exchange_body(&self, inner: &Inner, sends: &[(usize, Bytes)], from: &[usize]) -> Result<Vec<Bytes>> {
        const OP: &str = "exchange";
        let peer = |r: usize| {
            if r >= self.world || r == self.rank {
                return Err(Error::invalid(format!(
                    "exchange: rank {} with rank {r} (world of {})",
                    self.rank, self.world
                )));
            }
            Ok(r as i32)
        };
        for (to, m) in sends {
            peer(*to)?;
            self.check_len(self.rank, m.len() as u64)?;
        }
        for &r in from {
            peer(r)?;
        }
        let comm = &inner.comm.0;
        let alloc = |n: usize| inner.stream.alloc_zeros::<u8>(n.max(1)).map_err(|e| gpu("device alloc", e));
        let send_lens: Vec<CudaSlice<u64>> =
            sends.iter().map(|(_, m)| self.upload(inner, &[m.len() as u64])).collect::<Result<_>>()?;
        let mut recv_lens: Vec<CudaSlice<u64>> = from
            .iter()
            .map(|_| inner.stream.alloc_zeros::<u64>(1).map_err(|e| gpu("device alloc", e)))
            .collect::<Result<_>>()?;
        grouped(OP, || {
            for ((to, _), len) in sends.iter().zip(&send_lens) {
                comm.send(len, *to as i32).map(drop)?;
            }
            for (r, len) in from.iter().zip(&mut recv_lens) {
                comm.recv(len, *r as i32).map(drop)?;
            }
            Ok(())
        })?;
        self.wait(inner, OP)?;
        let mut lens = Vec::with_capacity(from.len());
        for (r, len) in from.iter().zip(&recv_lens) {
            let len = inner.stream.clone_dtoh(len).map_err(|e| gpu("copy from device", e))?[0];
            self.check_len(*r, len)?;
            lens.push(len as usize);
        }
        let send_bufs: Vec<CudaSlice<u8>> =
            sends.iter().map(|(_, m)| self.upload_bytes(inner, m, m.len())).collect::<Result<_>>()?;
        let mut recv_bufs: Vec<CudaSlice<u8>> = lens.iter().map(|&n| alloc(n)).collect::<Result<_>>()?;
        grouped(OP, || {
            for ((to, _), buf) in sends.iter().zip(&send_bufs) {
                comm.send(buf, *to as i32).map(drop)?;
            }
            for (r, buf) in from.iter().zip(&mut recv_bufs) {
                comm.recv(buf, *r as i32).map(drop)?;
            }
            Ok(())
        })?;
        self.wait(inner, OP)?;
        let mut out = Vec::with_capacity(from.len());
        for (buf, len) in recv_bufs.iter().zip(lens) {
            let mut bytes = inner.stream.clone_dtoh(buf).map_err(|e| gpu("copy from device", e))?;
            bytes.truncate(len);
            out.push(Bytes::from(bytes));
        }
        Ok(out)
    }

    fn all_reduce_body(&self, inner: &Inner, values: &[u64], op: ReduceOp) -> Result<Vec<u64>> {
        const OP: &str = "all_reduce";
        let lens = self.all_gather_u64(inner, values.len() as u64, OP)?;
        if let Some(r) = lens.iter().position(|l| *l != values.len() as u64) {
            let detail = format!("all_reduce of {} values, this rank has {}", lens[r], values.len());
            return Err(Error::Protocol { rank: r, detail });
        }
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let mut buf = self.upload(inner, values)?;
        let nccl_op = match op {
            ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
            ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
            ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        };
        inner.comm.0.all_reduce_in_place(&mut buf, &nccl_op).map_err(|e| gpu(OP, e))?;
        self.wait(inner, OP)?;
        inner.stream.clone_dtoh(&buf).map_err(|e| gpu("copy from device", e))
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn barrier(&self) -> Result<()> {
        self.call("barrier", |s, inner| s.all_gather_u64(inner, 0, "barrier").map(drop))
    }

    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        self.call("broadcast", |s, inner| s.broadcast_body(inner, root, data))
    }

    fn gather(&self, root: usize, data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        self.call("gather", |s, inner| {
            if root >= s.world {
                return Err(Error::invalid(format!("root {root} out of world of {}", s.world)));
            }
            s.check_len(s.rank, data.len() as u64)?;
            let all = s.all_gather_bytes(inner, &data, "gather")?;
            Ok((s.rank == root).then_some(all))
        })
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.call("all_gather", |s, inner| {
            s.check_len(s.rank, data.len() as u64)?;
            s.all_gather_bytes(inner, &data, "all_gather")
        })
    }

    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> Result<Vec<u64>> {
        self.call("all_reduce", |s, inner| s.all_reduce_body(inner, values, op))
    }

    /// A broadcast of the whole set: every rank receives every part. NCCL has point-to-point
    /// sends, but this backend moves only metadata-sized messages, where a second code path
    /// on the GPU is not worth it yet.
    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> Result<Vec<u8>> {
        crate::scatter_by_broadcast(self, root, parts)
    }

    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> Result<Vec<Bytes>> {
        self.call("exchange", |s, inner| s.exchange_body(inner, &sends, from))
    }
}

/// Runs `issue` between `ncclGroupStart` and `ncclGroupEnd` (ended even when an issue
/// fails, so the next call does not start inside a dangling group).
fn grouped(op: &str, issue: impl FnOnce() -> std::result::Result<(), cudarc::nccl::result::NcclError>) -> Result<()> {
    cudarc::nccl::result::group_start().map_err(|e| gpu(op, e))?;
    let issued = issue();
    let ended = cudarc::nccl::result::group_end();
    issued.map_err(|e| gpu(op, e))?;
    ended.map(drop).map_err(|e| gpu(op, e))
}

fn open_device(device: usize) -> Result<Arc<CudaStream>> {
    let ctx = CudaContext::new(device).map_err(|e| gpu(&format!("opening GPU {device}"), e))?;
    ctx.new_stream().map_err(|e| gpu("creating a stream", e))
}

/// Rank 0 makes the NCCL id and broadcasts its 128 bytes over the bootstrap world; an
/// empty message means rank 0 could not make one.
fn share_id(bootstrap: &dyn Collective) -> Result<Id> {
    let mine = if bootstrap.rank() == 0 {
        Some(match Id::new() {
            Ok(id) => id.internal().iter().map(|c| *c as u8).collect::<Vec<u8>>(),
            Err(e) => {
                log::error!("collective: ncclGetUniqueId failed: {e:?}");
                Vec::new()
            }
        })
    } else {
        None
    };
    let bytes = bootstrap.broadcast(0, mine.as_deref())?;
    let raw: [u8; 128] =
        bytes.as_slice().try_into().map_err(|_| Error::Gpu { detail: "rank 0 could not create an NCCL id".into() })?;
    Ok(Id::uninit(raw.map(|b| b as core::ffi::c_char)))
}

fn gpu(what: &str, e: impl fmt::Debug) -> Error {
    Error::Gpu { detail: format!("{what}: {e:?}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_what_was_tried() {
        let e = probe(&["libdckpt-no-such-lib.so"], &[]).unwrap_err().to_string();
        assert!(e.contains("libdckpt-no-such-lib.so"), "{e}");
    }
}
