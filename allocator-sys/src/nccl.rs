//! NCCL through cudarc's bindings (feature `nccl`), loaded dynamically: communicators of one
//! process over several GPUs (`ncclCommInitAll`), buffer registration (`ncclCommRegister`,
//! `ncclCommDeregister`), and the two collectives the examples measure (`ncclAllReduce`,
//! `ncclAllGather`, on `f32`), grouped (`ncclGroupStart`/`End`) so that one thread drives every
//! rank.
//!
//! The first call checks, once per process, that `libnccl` is present and has every entry point
//! `SYMBOLS` lists (inside `catch_unwind`, as cudarc panics on a missing library or symbol);
//! without it every call returns [`NcclError::Unavailable`], none panics, so that the
//! workspace builds and its tests run where NCCL is absent. Device pointers and streams are
//! numbers, as everywhere in this crate.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::nccl::sys;

/// Every NCCL entry point this module calls.
const SYMBOLS: &[&str] = &[
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclGetErrorString",
];

/// Why an NCCL call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NcclError {
    /// No usable `libnccl`: the message says what was missing.
    Unavailable(String),
    /// NCCL returned an error.
    Call {
        /// The entry point.
        call: &'static str,
        /// The `ncclResult_t` value.
        code: i32,
        /// `ncclGetErrorString`'s message.
        message: String,
    },
}

impl std::fmt::Display for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NcclError::Unavailable(why) => write!(f, "NCCL is not available: {why}"),
            NcclError::Call {
                call,
                code,
                message,
            } => write!(f, "{call}: NCCL error {code}: {message}"),
        }
    }
}

impl std::error::Error for NcclError {}

/// Ok once `libnccl` and every symbol of `SYMBOLS` were found (checked once per process).
pub fn available() -> Result<(), NcclError> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(load)
        .clone()
        .map_err(NcclError::Unavailable)
}

fn load() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to open candidate library names and closes them.
    if !unsafe { sys::is_culib_present() } {
        return Err("the NCCL library (libnccl) was not found".into());
    }
    let resolve = || -> Result<(), String> {
        // SAFETY: the library is present (checked above); opening it runs its initialisers,
        // which is what loading NCCL means. A panic here is caught below.
        let lib = unsafe { sys::culib() };
        for name in SYMBOLS {
            // SAFETY: looking a symbol up does not call it; the pointer type is never used.
            let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) };
            found.map_err(|e| format!("libnccl lacks {name}: {e}"))?;
        }
        Ok(())
    };
    std::panic::catch_unwind(resolve).unwrap_or_else(|_| Err("loading libnccl panicked".into()))
}

fn check(call: &'static str, code: sys::ncclResult_t) -> Result<(), NcclError> {
    if code == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL is loaded (every caller checked `available` first); the returned string is
    // static inside the library.
    let text = unsafe { sys::ncclGetErrorString(code) };
    let message = if text.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated and static (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    };
    Err(NcclError::Call {
        call,
        code: code as i32,
        message,
    })
}

/// One rank of a communicator (`ncclComm_t`), on one GPU; destroyed when dropped.
#[derive(Debug)]
pub struct Communicator {
    comm: usize,
    ordinal: usize,
    rank: usize,
    ranks: usize,
}

/// A buffer registered with a communicator ([`Communicator::register`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Registration(usize);

impl Communicator {
    /// One communicator over the GPUs `ordinals`, all in this process (`ncclCommInitAll`):
    /// rank `i` is on `ordinals[i]`.
    pub fn init_all(ordinals: &[usize]) -> Result<Vec<Communicator>, NcclError> {
        available()?;
        let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for `devs.len()` handles and `devs` holds as many ordinals;
        // both outlive the call.
        let code =
            unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr()) };
        check("ncclCommInitAll", code)?;
        let ranks = comms.len();
        let each = comms.into_iter().zip(ordinals).enumerate();
        Ok(each
            .map(|(rank, (comm, &ordinal))| Communicator {
                comm: comm as usize,
                ordinal,
                rank,
                ranks,
            })
            .collect())
    }

    /// The GPU of this rank.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    fn raw(&self) -> sys::ncclComm_t {
        self.comm as sys::ncclComm_t
    }

    /// Registers `size` bytes of device memory at `ptr` of this rank's GPU with the
    /// communicator (`ncclCommRegister`); the memory must stay mapped until
    /// [`Communicator::deregister`].
    pub fn register(&self, ptr: u64, size: u64) -> Result<Registration, NcclError> {
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: the communicator is live (owned by `self`); NCCL reads the range's attributes
        // through the driver and writes one handle through `handle`, a valid out-pointer.
        let code = unsafe {
            sys::ncclCommRegister(self.raw(), ptr as *mut c_void, size as usize, &mut handle)
        };
        check("ncclCommRegister", code)?;
        Ok(Registration(handle as usize))
    }

    /// Deregisters a registration of this communicator (`ncclCommDeregister`).
    pub fn deregister(&self, reg: Registration) -> Result<(), NcclError> {
        // SAFETY: the communicator is live; `reg` came from `register` on it (the caller's
        // bookkeeping), and NCCL checks the handle.
        let code = unsafe { sys::ncclCommDeregister(self.raw(), reg.0 as *mut c_void) };
        check("ncclCommDeregister", code)
    }

    /// Enqueues a sum all-reduce of `count` `f32`s from `send` into `recv` on `stream`.
    pub fn all_reduce_f32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: u64,
    ) -> Result<(), NcclError> {
        let (f32_, sum) = (sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum);
        // SAFETY: the communicator is live; NCCL validates the buffers (device memory of this
        // rank's GPU holding `count` elements, the caller's promise) and the stream when the
        // work is enqueued; nothing on the host is read or written.
        let code = unsafe {
            sys::ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                f32_,
                sum,
                self.raw(),
                stream as sys::cudaStream_t,
            )
        };
        check("ncclAllReduce", code)
    }

    /// Enqueues an all-gather of `count` `f32`s per rank from `send` into `recv` (`count` times
    /// the number of ranks) on `stream`.
    pub fn all_gather_f32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: u64,
    ) -> Result<(), NcclError> {
        let f32_ = sys::ncclDataType_t::ncclFloat32;
        // SAFETY: as for `all_reduce_f32`.
        let code = unsafe {
            sys::ncclAllGather(
                send as *const c_void,
                recv as *mut c_void,
                count,
                f32_,
                self.raw(),
                stream as sys::cudaStream_t,
            )
        };
        check("ncclAllGather", code)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and dropped once, here.
        unsafe {
            sys::ncclCommDestroy(self.raw());
        }
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, so that one thread can enqueue a
/// collective on every rank; the first error wins.
pub fn group<R>(f: impl FnOnce() -> Result<R, NcclError>) -> Result<R, NcclError> {
    available()?;
    // SAFETY: NCCL is loaded; the group calls take no arguments.
    check("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
    let r = f();
    // SAFETY: as above; every start is ended, whatever `f` returned.
    let end = check("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
    let r = r?;
    end.map(|()| r)
}
