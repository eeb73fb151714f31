//! Pages of a [`CudaDevice`](super::CudaDevice) that another process can import: creating them
//! exportable, exporting them as POSIX file descriptors and importing such a descriptor.
//!
//! The driver keeps an allocation alive while any handle to it is not released, in any process
//! (`cuMemRelease` drops one reference): an importer's handle keeps the memory after the
//! exporter released its own. An imported page enters the device's table like a created one,
//! with the size the caller gives, and is released with `release_page`.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{check, check_alloc, device_location, CudaDevice};
use crate::device::{DeviceError, DeviceResult, PageHandle};

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Properties of pinned device memory on `ordinal`, without special flags; `shareable` asks for
/// pages exportable as POSIX file descriptors.
pub(super) fn pinned_memory(ordinal: usize, shareable: bool) -> sys::CUmemAllocationProp {
    use sys::CUmemAllocationHandleType as Handle;
    let handles = if shareable {
        Handle::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        Handle::CU_MEM_HANDLE_TYPE_NONE
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

impl CudaDevice {
    /// `can_share`: the device attribute for POSIX file-descriptor handles.
    pub(super) fn cuda_can_share(&self) -> DeviceResult<bool> {
        super::driver()?;
        let dev = Self::handle_of(self.ordinal)?;
        let attr =
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
        let mut value = 0;
        // SAFETY: the driver is initialised, `dev` came from `cuDeviceGet` and `value` is a
        // valid out-pointer.
        let code = unsafe { sys::cuDeviceGetAttribute(&mut value, attr, dev) };
        check("cuDeviceGetAttribute", code)?;
        Ok(value != 0)
    }

    /// `create_page` (`shareable`: `create_shareable_page`).
    pub(super) fn cuda_create_page(&self, size: u64, shareable: bool) -> DeviceResult<PageHandle> {
        self.check_granular("create_page", 0, size)?;
        let _bound = self.bind()?;
        let prop = pinned_memory(self.ordinal, shareable);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a fully initialised property struct.
        let code = unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) };
        check_alloc("cuMemCreate", size, code)?;
        self.memory.lock().add_page(handle, size);
        Ok(PageHandle(handle))
    }

    /// `export_page`: the page as a file descriptor this process owns.
    pub(super) fn cuda_export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        let mem = self.memory.lock();
        if mem.pages.get(&page.0).is_none_or(|p| p.released) {
            let message = format!("unknown page {:#x}", page.0);
            return Err(DeviceError::invalid("export_page", message));
        }
        let _bound = self.bind()?;
        let mut fd: i32 = -1;
        let out = (&mut fd as *mut i32).cast::<c_void>();
        // SAFETY: the handle is live (in the table, whose lock is held so that no release races
        // it); for POSIX file descriptors the driver writes one `int` through `out`, which points
        // to `fd`.
        let code = unsafe { sys::cuMemExportToShareableHandle(out, page.0, POSIX_FD, 0) };
        check("cuMemExportToShareableHandle", code)?;
        if fd < 0 {
            let message = format!("the driver returned descriptor {fd}");
            return Err(DeviceError::invalid("export_page", message));
        }
        // SAFETY: the driver succeeded and made `fd`, a new descriptor that nothing else in this
        // process owns; the `OwnedFd` closes it once.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `import_page`: a handle of this process to the memory behind `fd`.
    pub(super) fn cuda_import_page(
        &self,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> DeviceResult<PageHandle> {
        self.check_granular("import_page", 0, size)?;
        let _bound = self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // The driver takes a POSIX descriptor by value, passed in the pointer-sized argument.
        let os_handle = fd.as_raw_fd() as usize as *mut c_void;
        // SAFETY: `handle` is a valid out-pointer; `fd` is a descriptor that stays open for the
        // whole call (borrowed), which the driver reads and does not close.
        let code = unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, POSIX_FD) };
        check("cuMemImportFromShareableHandle", code)?;
        self.memory.lock().add_page(handle, size);
        Ok(PageHandle(handle))
    }
}
