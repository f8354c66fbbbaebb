//! `libplugin_FERRY.so`: ferry as a backend of NVIDIA NIXL. The engine is
//! C++ (cpp/plugin.cpp, over ferry's C face); this crate links it with
//! ferry and exports the two entries NIXL looks up after `dlopen`.

// The file name NIXL looks for is `libplugin_FERRY.so`.
#![allow(non_snake_case)]

use std::ffi::c_void;

// The C face the C++ side calls (linked in from this dependency).
extern crate ferry_capi;

extern "C" {
    fn ferry_nixl_plugin_record() -> *mut c_void;
}

/// NIXL's entry: the plugin record (`nixlBackendPlugin`, API version 1).
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    // SAFETY: returns the address of a static record; no arguments.
    unsafe { ferry_nixl_plugin_record() }
}

/// NIXL's exit: nothing to free (the record is static; engines are freed
/// by `destroy_engine`).
#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {}
