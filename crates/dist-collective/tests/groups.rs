//! Sub-groups, split, device meshes, object collectives, monitored barrier, flight recorder.

use std::collections::HashMap;
use std::time::Duration;

use dist_collective::testing::{run_world, run_world_with};
use dist_collective::{DeviceMesh, Error, ReduceOp};

#[test]
fn new_group_members_and_non_members() {
    let out = run_world(4, |pg| {
        let odd = pg.new_group(&[3, 1])?;
        let first3 = pg.new_group(&[0, 1, 2])?;
        let mut res = (None, None, None);
        if let Some(g) = &odd {
            assert_eq!(g.world_size(), 2);
            assert_eq!(g.global_ranks(), &[1, 3]);
            assert_eq!(g.get_global_rank(g.rank()), Some(pg.rank()));
            assert_eq!(g.get_group_rank(3), Some(1));
            assert_eq!(g.get_group_rank(0), None);
            let mut v = [pg.rank() as i32];
            g.all_reduce(&mut v, ReduceOp::Sum)?;
            res.0 = Some(v[0]);
            res.2 = Some(g.rank());
        }
        if let Some(g) = &first3 {
            let mut v = [pg.rank() as i32 * 10];
            g.broadcast(&mut v, 2)?;
            res.1 = Some(v[0]);
        }
        Ok(res)
    })
    .unwrap();
    assert_eq!(out[0], (None, Some(20), None));
    assert_eq!(out[1], (Some(4), Some(20), Some(0)));
    assert_eq!(out[2], (None, Some(20), None));
    assert_eq!(out[3], (Some(4), None, Some(1)));
}

#[test]
fn overlapping_subgroups_used_concurrently_from_threads() {
    let out = run_world(4, |pg| {
        let a = pg.new_group(&[0, 1, 2])?;
        let b = pg.new_group(&[1, 2, 3])?;
        let r = pg.rank() as u64;
        std::thread::scope(|s| {
            let ha = s.spawn(|| -> dist_collective::Result<u64> {
                let mut total = 0;
                if let Some(g) = &a {
                    for i in 0..25 {
                        let mut v = vec![r + i; 256];
                        g.all_reduce(&mut v, ReduceOp::Sum)?;
                        total += v[255];
                    }
                }
                Ok(total)
            });
            let hb = s.spawn(|| -> dist_collective::Result<u64> {
                let mut total = 0;
                if let Some(g) = &b {
                    let mut works = Vec::new();
                    for i in 0..25 {
                        works.push(g.all_reduce_async(vec![r * i; 256], ReduceOp::Sum)?);
                    }
                    for w in works {
                        total += w.wait()?[0];
                    }
                }
                Ok(total)
            });
            let x = ha.join().unwrap()?;
            let y = hb.join().unwrap()?;
            // The world group still works alongside them.
            let mut v = [1u8];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            assert_eq!(v[0], 4);
            Ok((x, y))
        })
    })
    .unwrap();
    let ia: u64 = (0..25).map(|i| 3 + 3 * i).sum(); // ranks 0+1+2 plus 3i
    let ib: u64 = (0..25).map(|i| 6 * i).sum(); // (1+2+3) i
    assert_eq!(out[0], (ia, 0));
    assert_eq!(out[1], (ia, ib));
    assert_eq!(out[2], (ia, ib));
    assert_eq!(out[3], (0, ib));
}

#[test]
fn new_subgroups_and_split() {
    let out = run_world(4, |pg| {
        let halves = pg.new_subgroups(2)?;
        let mut v = [pg.rank() as u32];
        halves.all_reduce(&mut v, ReduceOp::Sum)?;
        // Split by parity, ordered by descending rank; rank 0 opts out.
        let color = if pg.rank() == 0 {
            None
        } else {
            Some(pg.rank() as u32 % 2)
        };
        let sp = pg.split(color, -(pg.rank() as i64))?;
        let split_info = match &sp {
            Some(g) => {
                let mut x = [pg.rank() as u32];
                g.broadcast(&mut x, 0)?;
                Some((g.rank(), g.world_size(), x[0], g.global_ranks().to_vec()))
            }
            None => None,
        };
        Ok((v[0], halves.global_ranks().to_vec(), split_info))
    })
    .unwrap();
    assert_eq!(out[0], (1, vec![0, 1], None));
    assert_eq!(out[1], (1, vec![0, 1], Some((1, 2, 3, vec![3, 1]))));
    assert_eq!(out[2], (5, vec![2, 3], Some((0, 1, 2, vec![2]))));
    assert_eq!(out[3], (5, vec![2, 3], Some((0, 2, 3, vec![3, 1]))));
}

#[test]
fn nested_subgroups() {
    let out = run_world(4, |pg| {
        let half = pg.new_subgroups(2)?;
        let me = half.new_group(&[0])?;
        let mut v = [1u8];
        if let Some(g) = &me {
            g.all_reduce(&mut v, ReduceOp::Sum)?;
            assert_eq!(g.global_ranks(), &[pg.rank()]);
        }
        Ok(me.is_some())
    })
    .unwrap();
    assert_eq!(out, vec![true, false, true, false]);
}

#[test]
fn group_creation_in_a_different_order_is_an_error() {
    let err = run_world_with(2, Duration::from_secs(10), |pg| {
        if pg.rank() == 0 {
            pg.new_group(&[0])?;
            pg.new_group(&[1])?;
        } else {
            pg.new_group(&[1])?;
            pg.new_group(&[0])?;
        }
        Ok(())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::GroupMismatch { index: 0, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("new_group([0])") && msg.contains("new_group([1])"),
        "{msg}"
    );
}

#[test]
fn device_mesh_dims() {
    let out = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        let mut dp = [pg.rank() as i64];
        mesh.dim("dp").all_reduce(&mut dp, ReduceOp::Sum)?;
        let mut tp = [pg.rank() as i64];
        mesh.dim("tp").all_reduce(&mut tp, ReduceOp::Sum)?;
        assert_eq!(mesh.shape(), &[2, 2]);
        assert_eq!(mesh.size("tp"), Some(2));
        assert!(mesh.get_dim("pp").is_none());
        Ok((
            mesh.coordinate().to_vec(),
            dp[0],
            tp[0],
            mesh.dim("tp").global_ranks().to_vec(),
        ))
    })
    .unwrap();
    assert_eq!(out[0], (vec![0, 0], 2, 1, vec![0, 1]));
    assert_eq!(out[1], (vec![0, 1], 4, 1, vec![0, 1]));
    assert_eq!(out[2], (vec![1, 0], 2, 5, vec![2, 3]));
    assert_eq!(out[3], (vec![1, 1], 4, 5, vec![2, 3]));
    let bad = run_world(2, |pg| DeviceMesh::new(&pg, &[("dp", 3)]).map(drop)).unwrap_err();
    assert!(
        matches!(
            bad,
            Error::SizeMismatch {
                expected: 2,
                actual: 3,
                ..
            }
        ),
        "{bad}"
    );
    // Sizes whose product wraps to the world size are no mesh for it either.
    let huge = (1usize << (usize::BITS - 1)) + 1;
    let bad = run_world(2, |pg| {
        DeviceMesh::new(&pg, &[("a", huge), ("b", 2)]).map(drop)
    })
    .unwrap_err();
    assert!(
        matches!(bad, Error::SizeMismatch { expected: 2, .. }),
        "{bad}"
    );
}

#[test]
fn object_collectives() {
    let out = run_world(3, |pg| {
        let r = pg.rank();
        let mine: HashMap<String, Vec<u32>> = [(format!("rank{r}"), (0..r as u32).collect())]
            .into_iter()
            .collect();
        let cfg = pg.broadcast_object((r == 1).then_some(&("lr".to_owned(), 0.5f64)), 1)?;
        let all = pg.all_gather_object(&mine)?;
        let gathered = pg.gather_object(&format!("hello from {r}"), 2)?;
        let objs: Vec<Option<i32>> = vec![None, Some(7), Some(-1)];
        let scattered: Option<i32> = pg.scatter_object((r == 0).then_some(&objs[..]), 0)?;
        let echo = if r == 0 {
            pg.send_object(&vec!["a".to_owned(), "b".to_owned()], 2, 5)?;
            None
        } else if r == 2 {
            Some(pg.recv_object::<Vec<String>>(0, 5)?)
        } else {
            None
        };
        Ok((cfg, all, gathered, scattered, echo))
    })
    .unwrap();
    for (r, (cfg, all, gathered, scattered, echo)) in out.into_iter().enumerate() {
        assert_eq!(cfg, ("lr".to_owned(), 0.5));
        assert_eq!(all.len(), 3);
        assert_eq!(all[2][&"rank2".to_owned()], vec![0, 1]);
        if r == 2 {
            assert_eq!(
                gathered.unwrap(),
                vec!["hello from 0", "hello from 1", "hello from 2"]
            );
            assert_eq!(echo, Some(vec!["a".to_owned(), "b".to_owned()]));
        } else {
            assert!(gathered.is_none());
        }
        assert_eq!(scattered, [None, Some(7), Some(-1)][r]);
    }
}

#[test]
fn monitored_barrier_names_missing_ranks() {
    let out = run_world(3, |pg| {
        // Everyone arrives: fine.
        pg.monitored_barrier(Duration::from_secs(5), true)?;
        // No limit at all (torch's `timedelta.max`): rank 0's allowance saturates.
        pg.monitored_barrier(Duration::MAX, true)?;
        // Rank 2 skips the second one. Ranks 0 and 1 give it 1 s; rank 1 then waits for rank
        // 0's verdict up to 2 × 1 s + 1 s after its own arrival, which rank 0 cannot miss
        // unless it arrives seconds late.
        let r = if pg.rank() == 2 {
            // Only a late rank's look: rank 2 never arrives, so the timing does not matter.
            std::thread::sleep(Duration::from_millis(400));
            None
        } else {
            Some(pg.monitored_barrier(Duration::from_secs(1), true))
        };
        Ok(r.map(|r| r.unwrap_err().to_string()))
    })
    .unwrap();
    for msg in out.iter().take(2) {
        let msg = msg.as_ref().unwrap();
        assert!(
            msg.contains("monitored_barrier") && msg.contains("[2]"),
            "{msg}"
        );
    }
}

#[test]
fn flight_recorder_dumps_json() {
    let out = run_world(2, |pg| {
        let mut v = vec![1.0f32; 10];
        pg.all_reduce(&mut v, ReduceOp::Sum)?;
        pg.barrier()?;
        Ok(pg.dump_flight_recorder())
    })
    .unwrap();
    let j: serde_json::Value = serde_json::from_str(&out[1]).unwrap();
    assert_eq!(j["rank"], 1);
    let e = &j["entries"];
    assert_eq!(e[0]["op"], "all_reduce");
    assert_eq!(e[0]["dtype"], "f32");
    assert_eq!(e[0]["counts"][0], 10);
    assert_eq!(e[0]["state"], "completed");
    assert_eq!(e[1]["op"], "barrier");
    assert!(e[1]["finished_ms"].as_f64().unwrap() >= e[1]["issued_ms"].as_f64().unwrap());
}

/// A rank that cannot provide its object (the root's wrong call, or one that does not
/// encode) still takes part in the length exchange, with a word that says so: every other
/// rank fails at once naming it, instead of waiting out its timeout (60 s here: a wait would
/// end in timeouts, which the kinds asserted below rule out), and the group stays usable.
#[test]
fn an_object_a_rank_cannot_provide_fails_every_rank_naming_it() {
    // JSON object keys must be strings: a map keyed by tuples does not encode.
    let unencodable = || std::collections::BTreeMap::from([((1u8, 2u8), 3u8)]);
    type Map = std::collections::BTreeMap<(u8, u8), u8>;
    let out = run_world_with(3, Duration::from_secs(60), |pg| {
        let r = pg.rank();
        let e1 = pg
            .broadcast_object::<Map>((r == 1).then(unencodable).as_ref(), 1)
            .unwrap_err();
        let objs = [7i32, 8];
        let e2 = pg
            .scatter_object::<i32>((r == 0).then_some(&objs[..]), 0)
            .unwrap_err();
        let mine = |bad: usize| {
            if r == bad { unencodable() } else { Map::new() }
        };
        let e3 = pg.all_gather_object(&mine(2)).unwrap_err();
        let e4 = pg.gather_object(&mine(1), 0).unwrap_err();
        pg.barrier()?;
        Ok([e1, e2, e3, e4])
    })
    .unwrap();
    for (r, errs) in out.iter().enumerate() {
        for (e, culprit) in errs.iter().zip([1, 0, 2, 1]) {
            let msg = e.to_string();
            if r == culprit {
                assert!(
                    matches!(e, Error::Object { .. } | Error::SizeMismatch { .. }),
                    "rank {r}: {msg}"
                );
            } else {
                assert!(
                    matches!(e, Error::InvalidArgument { .. })
                        && msg.contains(&format!("rank {culprit} failed to provide its object")),
                    "rank {r}: {msg}"
                );
            }
        }
    }
}
