//! Helpers of the `ferry` tool that its test suites share: the byte
//! pattern transfers are checked with, the lines `ferry serve` prints, and
//! a process's resident memory.
//! Not part of the `ferry` library's API.

pub mod scrape;
pub mod testkit;
