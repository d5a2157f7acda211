//! A job's last `FileStore` handle deletes the file while a new job opens the same path:
//! the new job's handles must all end up in one file, whichever comes first.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use dist_backend::Store;
use dist_backend::store::FileStore;

const TIMEOUT: Duration = Duration::from_secs(30);

/// Round after round, the last handle of one job closes while a handle of the next job opens
/// and writes a key; a handle opened after both must read that key. Before the last handle
/// deleted the file under its lock, a handle opened between its count and its delete wrote
/// into the unlinked file, and the next handle found an empty one.
#[test]
fn a_handle_opened_while_the_last_one_closes_shares_the_next_handles_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    for round in 0..300 {
        let last = FileStore::for_workers(&path, TIMEOUT, 1).expect("open");
        let go = Arc::new(Barrier::new(2));
        let closing = {
            let go = Arc::clone(&go);
            std::thread::spawn(move || {
                go.wait();
                drop(last);
            })
        };
        go.wait();
        let next = FileStore::for_workers(&path, TIMEOUT, 2).expect("open the next job's");
        next.set("k", b"v").expect("set");
        closing.join().expect("closing thread");
        let later = FileStore::for_workers(&path, TIMEOUT, 2).expect("open a later one");
        assert!(
            later.check(&["k"]).expect("check"),
            "round {round}: the key written by a handle opened as the last one closed is lost"
        );
        drop(next);
        drop(later);
        assert!(
            !path.exists(),
            "round {round}: the next job's last handle left the file"
        );
    }
}
