//! The raw bindings that `wit-bindgen` generates from the `wrk:task` WIT package (`../wit`).
//!
//! Task authors normally use the idiomatic wrappers of this crate instead; these bindings are
//! public for anyone who needs a part of the contract the wrappers do not cover. Every wrapper
//! converts to and from its raw counterpart (`from_raw`, `as_raw`, `into_raw`).

wit_bindgen::generate!({
    path: "../wit",
    world: "task",
    // The `export!` macro is used by `wrk_sdk::export_task!` from the guest crates.
    pub_export_macro: true,
    default_bindings_module: "wrk_sdk::bindings",
});
