//! Generates the librbd and librados bindings from the headers installed
//! on the build machine (Debian: librbd-dev, librados-dev), as the verbs
//! provider's rdma-mummy-sys does for rdma-core: the ABI is the one of the
//! library the daemon links, not a copy checked in for another version.
//! Only what the RBD backend calls is bound (rados_* for the cluster
//! connection, rbd_* for images, aio and the exclusive lock).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rustc-link-lib=rbd");
    println!("cargo:rustc-link-lib=rados");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("rados_(create2|conf_read_file|conf_set|conf_get|connect|shutdown|ioctx_create|ioctx_destroy|ioctx_set_namespace|getaddrs|get_instance_id|version)")
        .allowlist_function("rbd_(open|open_read_only|close|get_size|resize|get_features|version|is_exclusive_lock_owner|lock_acquire|lock_release|lock_get_owners|lock_get_owners_cleanup|lock_break|aio_.*|read2|write2|flush|discard|write_zeroes)")
        .allowlist_var("RBD_.*|LIBRBD_.*|LIBRADOS_.*")
        .allowlist_type("rbd_lock_mode_t")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|e| {
            panic!("bindgen could not read <rbd/librbd.h> and <rados/librados.h> ({e}): install librbd-dev and librados-dev (scripts/test.sh does)")
        });
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("write the bindings");
}
