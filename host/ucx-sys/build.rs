//! Generates bindings over the system's `ucp/api/ucp.h` (found through `pkg-config` name `ucx`)
//! and links `ucp` and `ucs`.

use std::env;
use std::path::PathBuf;
use std::process::exit;

const INSTALL_HINT: &str = "wrk-ucx-sys needs the UCX development files: install them with \
     `apt-get install -y libucx-dev libclang-dev pkg-config` (Debian/Ubuntu), or build without \
     the host's `ucx` feature";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let ucx = match pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .env_metadata(true)
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(err) => {
            eprintln!("error: pkg-config could not find `ucx` (UCX >= 1.10): {err}");
            eprintln!("error: {INSTALL_HINT}");
            exit(1);
        }
    };

    for dir in &ucx.link_paths {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    // The wrapper only calls into UCP and UCS; UCT and UCM are loaded by them.
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_type("ucs_status_ptr_t")
        .allowlist_type("ucs_thread_mode_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for dir in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = match builder.generate() {
        Ok(bindings) => bindings,
        Err(err) => {
            eprintln!("error: bindgen failed over ucp/api/ucp.h: {err}");
            eprintln!("error: {INSTALL_HINT}");
            exit(1);
        }
    };
    let out = match env::var_os("OUT_DIR") {
        Some(dir) => PathBuf::from(dir).join("bindings.rs"),
        None => {
            eprintln!("error: OUT_DIR is not set (not run by cargo?)");
            exit(1);
        }
    };
    if let Err(err) = bindings.write_to_file(&out) {
        eprintln!("error: cannot write {}: {err}", out.display());
        exit(1);
    }
}
