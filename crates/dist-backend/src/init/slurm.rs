//! Slurm node lists (`node[01-04,07],gpu-a`): the hosts they name, the first of which serves
//! the store when `MASTER_ADDR` is not set.

use super::init_err;
use crate::Result;

/// The most hosts [`expand_nodelist`] produces.
const MAX_HOSTS: usize = 1 << 20;

/// Expands a Slurm host list: `node[01-04,07],gpu1` →
/// `node01 node02 node03 node04 node07 gpu1`; several bracket groups in one name multiply
/// (`r[1-2]n[1-2]` → `r1n1 r1n2 r2n1 r2n2`). Zero padding follows the range's first bound.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        expand_item(item, list, &mut out)?;
    }
    if out.is_empty() {
        return Err(init_err(format!(
            "SLURM_JOB_NODELIST={list:?} names no host"
        )));
    }
    Ok(out)
}

/// The first host of a Slurm host list.
pub fn first_host(list: &str) -> Result<String> {
    // Expand only the first item, so a huge list costs nothing more.
    let first = split_top(list)?
        .into_iter()
        .map(str::trim)
        .find(|s| !s.is_empty())
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?} names no host")))?;
    let mut out = Vec::new();
    expand_item(first, list, &mut out)?;
    out.into_iter()
        .next()
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?} names no host")))
}

/// Splits at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth.checked_sub(1).ok_or_else(|| {
                    init_err(format!("SLURM_JOB_NODELIST={list:?}: unbalanced ']'"))
                })?;
            }
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(init_err(format!(
            "SLURM_JOB_NODELIST={list:?}: unclosed '['"
        )));
    }
    items.push(&list[start..]);
    Ok(items)
}

fn expand_item(item: &str, list: &str, out: &mut Vec<String>) -> Result<()> {
    let Some(open) = item.find('[') else {
        if out.len() >= MAX_HOSTS {
            return Err(init_err(format!(
                "SLURM_JOB_NODELIST={list:?}: too many hosts"
            )));
        }
        out.push(item.to_owned());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?}: unclosed '['")))?;
    let prefix = &item[..open];
    let rest = &item[close + 1..];
    for part in item[open + 1..close].split(',') {
        let part = part.trim();
        let bad = || init_err(format!("SLURM_JOB_NODELIST={list:?}: bad range {part:?}"));
        let (lo_s, hi_s) = part.split_once('-').unwrap_or((part, part));
        if lo_s.is_empty() || !lo_s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let lo: u64 = lo_s.parse().map_err(|_| bad())?;
        let hi: u64 = hi_s.parse().map_err(|_| bad())?;
        if hi < lo || hi - lo >= MAX_HOSTS as u64 {
            return Err(bad());
        }
        let width = lo_s.len();
        for n in lo..=hi {
            expand_item(&format!("{prefix}{n:0width$}{rest}"), list, out)?;
        }
    }
    Ok(())
}
