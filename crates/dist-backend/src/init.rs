//! Finding rank, world size and the store from a launcher's environment or a URL.
