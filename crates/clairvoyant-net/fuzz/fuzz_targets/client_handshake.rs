//! cargo-fuzz target: the body lives in `clairvoyant_net::fuzzing::client_handshake`, which `cargo test`
//! also runs (tests/fuzz_inputs.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    clairvoyant_net::fuzzing::client_handshake(data);
});
