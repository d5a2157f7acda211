//! Assigning parameters to gradient buckets.

/// One bucket: the parameters it holds, in order, and where each one's gradient lives in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketSpec {
    /// Parameter indices, in the order their gradients are laid out.
    pub params: Vec<usize>,
    /// Element offset of each parameter's gradient (parallel to `params`).
    pub offsets: Vec<usize>,
    /// Total elements.
    pub len: usize,
}

/// Every bucket, plus where each parameter landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLayout {
    /// Buckets in reduction order.
    pub buckets: Vec<BucketSpec>,
    /// For each parameter: (bucket index, element offset).
    pub location: Vec<(usize, usize)>,
}

impl BucketLayout {
    /// Greedy assignment in `order`: a bucket closes when the next gradient would take it past
    /// its cap (`first_cap` bytes for the first bucket, `cap` for the rest); a gradient larger
    /// than the cap gets a bucket of its own. This is torch's rule with `bucket_cap_mb = 25`
    /// and a 1 MiB first bucket, so that the first all-reduce starts early in the backward pass.
    pub fn assign(
        order: &[usize],
        numels: &[usize],
        elem_bytes: usize,
        first_cap: usize,
        cap: usize,
    ) -> Self {
        let mut buckets: Vec<BucketSpec> = Vec::new();
        let mut location = vec![(0, 0); numels.len()];
        let mut cur = BucketSpec {
            params: vec![],
            offsets: vec![],
            len: 0,
        };
        for &p in order {
            let limit = if buckets.is_empty() { first_cap } else { cap };
            let bytes = numels[p] * elem_bytes;
            if !cur.params.is_empty() && (cur.len * elem_bytes + bytes) > limit {
                buckets.push(std::mem::replace(
                    &mut cur,
                    BucketSpec {
                        params: vec![],
                        offsets: vec![],
                        len: 0,
                    },
                ));
            }
            location[p] = (buckets.len(), cur.len);
            cur.params.push(p);
            cur.offsets.push(cur.len);
            cur.len += numels[p];
        }
        if !cur.params.is_empty() {
            buckets.push(cur);
        }
        BucketLayout { buckets, location }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverse_order_first_bucket_small_oversized_param_alone() {
        // 5 params of 100, 300, 50, 1000, 20 elements (4 bytes each), reverse order 4..0.
        let numels = [100, 300, 50, 1000, 20];
        let order = [4, 3, 2, 1, 0];
        let l = BucketLayout::assign(&order, &numels, 4, 400, 1600);
        let params: Vec<Vec<usize>> = l.buckets.iter().map(|b| b.params.clone()).collect();
        // first cap 400 B: param 4 (80 B) fits, param 3 (4000 B) does not -> closes bucket 0;
        // param 3 alone exceeds 1600 B -> its own bucket; then 2, 1 (200 + 1200 B) fit; 0 (400 B) overflows.
        assert_eq!(params, vec![vec![4], vec![3], vec![2, 1], vec![0]]);
        assert_eq!(l.location[1], (2, 50));
        assert_eq!(l.buckets[2].len, 350);
    }
}
