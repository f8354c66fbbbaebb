//! `libferry.so` / `libferry.a`: the C face of `ferry-capi` (capi/src),
//! declared in include/ferry.h. A cdylib or staticlib exports the C entries
//! of the crates it links, so this one only names its dependency.

extern crate ferry_capi;
