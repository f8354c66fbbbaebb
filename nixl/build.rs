//! Compiles the C++ side of the plugin (cpp/plugin.cpp) against our own
//! declaration of NIXL's interface (cpp/nixl_abi.h) and include/ferry.h.

fn main() {
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-changed=../include/ferry.h");
    // A build with one method moved: what nixl/tests/test_nixl.py's ABI
    // check must catch (BENCHMARKS.md / the note show it once).
    println!("cargo:rerun-if-env-changed=FERRY_NIXL_ABI_MUTATION");
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++20")
        .file("cpp/plugin.cpp")
        .include("cpp")
        .include("../include")
        // Only nixl_plugin_init / _fini (from lib.rs) leave the library.
        .flag("-fvisibility=hidden")
        .flag("-fvisibility-inlines-hidden")
        .warnings(true)
        .extra_warnings(true)
        // GCC 12's -Wrestrict misfires on std::string appends at -O3
        // (GCC bug 105329).
        .flag_if_supported("-Wno-restrict")
        .warnings_into_errors(true);
    if std::env::var_os("FERRY_NIXL_ABI_MUTATION").is_some() {
        b.define("FERRY_NIXL_ABI_MUTATION", None);
    }
    b.compile("ferry_nixl");
}
