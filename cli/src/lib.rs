//! Helpers of the `ferry` tool that its test suites share: the byte
//! pattern transfers are checked with, and the lines `ferry serve` prints.
//! Not part of the `ferry` library's API.

pub mod testkit;
