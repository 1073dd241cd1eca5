//! The arithmetic of the DeepSeek-V4 reference forward pass (`crate::deepseek4`): products,
//! norms, RoPE on the last dims, the Hadamard rotation and llama.cpp's top-k selection.

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `W · x` for W with `ne = [in, out]` (out rows of `in`).
pub(crate) fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

pub(crate) fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

pub(crate) fn rmsnorm(x: &[f32], eps: f32) -> Vec<f32> {
    let s = rms_scale(x, eps);
    x.iter().map(|v| v * s).collect()
}

pub(crate) fn rmsnorm_w(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let s = rms_scale(x, eps);
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// RoPE (§3.1): adjacent pairs on the last `r` dims of `x`, at position `p`; `sign` −1 is the
/// inverse rotation.
pub(crate) fn rope(x: &mut [f32], r: usize, p: usize, base: f32, sign: f32) {
    let o = x.len() - r;
    let ts = base.powf(-2.0 / r as f32);
    let mut theta = p as f32;
    for k in 0..r / 2 {
        let (c, s) = (theta.cos(), sign * theta.sin());
        let i = o + 2 * k;
        let (a, b) = (x[i], x[i + 1]);
        x[i] = a * c - b * s;
        x[i + 1] = a * s + b * c;
        theta *= ts;
    }
}

/// The orthonormal Walsh–Hadamard transform of a 64-value vector (§5.3).
pub(crate) fn hadamard(x: &[f32]) -> Vec<f32> {
    let n = x.len();
    let scale = 1.0 / (n as f32).sqrt();
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    sign * x[j]
                })
                .sum::<f32>()
                * scale
        })
        .collect()
}

/// The `k` largest of `scores` as llama.cpp's `ggml_top_k` chooses them: `std::partial_sort`
/// of the indices with `score[a] > score[b]`, whose set on ties is libstdc++'s heap-select
/// (a heap of the first `k`, then each later index replaces the heap's top, its smallest,
/// only when strictly larger). Exact ties are common here: a block whose every ReLU term is
/// zero scores exactly 0. The heap operations follow libstdc++'s `bits/stl_heap.h`.
pub(crate) fn heap_select(scores: &[f32], k: usize) -> Vec<usize> {
    let n = scores.len();
    if n <= k {
        return (0..n).collect();
    }
    let comp = |a: usize, b: usize| scores[a] > scores[b];
    let mut h: Vec<usize> = (0..k).collect();
    let push = |h: &mut [usize], mut hole: usize, top: usize, value: usize| {
        while hole > top {
            let parent = (hole - 1) / 2;
            if !comp(h[parent], value) {
                break;
            }
            h[hole] = h[parent];
            hole = parent;
        }
        h[hole] = value;
    };
    let adjust = |h: &mut [usize], mut hole: usize, len: usize, value: usize| {
        let top = hole;
        let mut second = hole;
        while second < (len - 1) / 2 {
            second = 2 * (second + 1);
            if comp(h[second], h[second - 1]) {
                second -= 1;
            }
            h[hole] = h[second];
            hole = second;
        }
        if len.is_multiple_of(2) && second == (len - 2) / 2 {
            second = 2 * (second + 1);
            h[hole] = h[second - 1];
            hole = second - 1;
        }
        push(h, hole, top, value);
    };
    if k >= 2 {
        let mut parent = (k - 2) / 2;
        loop {
            let v = h[parent];
            adjust(&mut h, parent, k, v);
            if parent == 0 {
                break;
            }
            parent -= 1;
        }
    }
    for i in k..n {
        if comp(i, h[0]) {
            // __pop_heap(first, middle, i): *i = *first (irrelevant here), then sift i in.
            adjust(&mut h, 0, k, i);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_select_keeps_libstdcxx_choices_on_ties() {
        // Nothing strictly larger arrives: the first k stay.
        assert_eq!(sorted(heap_select(&[0.0, 0.0, 0.0], 2)), vec![0, 1]);
        // A larger one replaces the heap's top (here index 1, by libstdc++'s layout).
        assert_eq!(sorted(heap_select(&[0.0, 0.0, 0.0, 5.0], 2)), vec![0, 3]);
        assert_eq!(
            sorted(heap_select(&[3.0, 1.0, 2.0, 5.0, 4.0], 3)),
            vec![0, 3, 4]
        );
        // Fewer than k: all of them.
        assert_eq!(sorted(heap_select(&[1.0], 8)), vec![0]);
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn the_hadamard_rotation_is_orthonormal_and_self_inverse() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let y = hadamard(&hadamard(&x));
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5));
        let n = |v: &[f32]| dot(v, v);
        assert!((n(&hadamard(&x)) - n(&x)).abs() < 1e-4);
    }
}
