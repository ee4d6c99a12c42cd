//! see mod.rs
