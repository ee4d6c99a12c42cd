//! cargo-fuzz target: the body lives in `clairvoyant_net::fuzzing::server_session`, which `cargo test`
//! also runs (tests/fuzz_inputs.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    clairvoyant_net::fuzzing::server_session(data);
});
