//! Picks the kernel for a format (and the CPU): safe entry points that check the lengths the
//! SIMD kernels rely on, with the scalar reference ([`super::format`]) where AVX2 is missing.

use super::format::{self, Format, QActs, GROUP};
use super::PANEL;

/// `kernel(weight row, groups per row, activations, first activation row, outputs)`: one
/// weight row against `outputs.len()` activation rows.
pub(crate) type IntKernel = fn(&[u8], usize, &QActs, usize, &mut [f32]);
/// The same with f32 activations (rows of `groups · 32`).
pub(crate) type F32Kernel = fn(&[u8], usize, &[f32], usize, &mut [f32]);

/// Whether the AVX-512 kernels run on this CPU.
fn avx512() -> bool {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    return super::avx512::available();
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    false
}

/// Activation rows per pass of the integer kernels on this CPU.
pub(crate) fn int_rows() -> usize {
    if avx512() {
        super::INT_ROWS
    } else {
        8
    }
}

/// Activation rows per pass of the f32 kernel on this CPU.
pub(crate) fn f32_rows() -> usize {
    if avx512() {
        super::F32_ROWS
    } else {
        4
    }
}

/// Checks a weight row and the activation rows a kernel call reads: `groups` whole blocks of
/// `f` within `row`, `rows_needed` (computed without overflow) at most `have`.
fn check(f: Format, row: &[u8], groups: usize, rows_needed: Option<usize>, have: usize, g: usize) {
    let weights = groups * GROUP;
    let blocks = weights / f.block_weights();
    assert!(
        weights.is_multiple_of(f.block_weights())
            && row.len() >= blocks * f.block_bytes()
            && rows_needed.is_some_and(|r| r <= have)
            && g >= 1,
        "kernel lengths: row {} bytes for {groups} groups of {}, activation rows {rows_needed:?} \
         of {have}",
        row.len(),
        f.name()
    );
}

/// `(r0 + g) · per`, or `None` on overflow.
fn end(r0: usize, g: usize, per: usize) -> Option<usize> {
    r0.checked_add(g)?.checked_mul(per)
}

/// `$go!(loader)` with the AVX2 group loader of format `$f` (each arm monomorphized, so the
/// loader inlines into the kernel `$go` expands to).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
macro_rules! with_loader {
    ($f:expr, $go:ident) => {{
        use $crate::qmat::avx2 as a;
        match $f {
            Format::F32 => $go!(a::group_f32_plain),
            Format::F16 => $go!(a::group_f32_half),
            Format::Q4_0 => $go!(a::group_f32::<a::Q4_0>),
            Format::Q4_1 => $go!(a::group_f32::<a::Q4_1>),
            Format::Q8_0 => $go!(a::group_f32::<a::Q8_0>),
            Format::Q4K => $go!(a::group_f32::<a::Q4K>),
            Format::Q6K => $go!(a::group_f32::<a::Q6K>),
        }
    }};
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod simd {
    use super::super::avx2::{self, Unpack};
    use super::super::avx512;
    use super::super::pick::OneRow;
    use super::*;

    /// Checks what an integer kernel call reads: the weight row, `out.len()` (1..=`most`)
    /// activation rows from `r0` with their scales, sums and per-lane copies.
    fn check_int(
        f: Format,
        row: &[u8],
        groups: usize,
        x: &QActs,
        r0: usize,
        g: usize,
        most: usize,
    ) {
        check(f, row, groups, end(r0, g, groups), x.d.len(), g);
        assert!(g <= most && x.q.len() == x.d.len() * GROUP && x.s.len() == x.d.len());
        assert!(x.d8.len() == 8 * x.d.len() && x.s8.len() == x.d8.len());
    }

    pub(super) fn int_rows<U: Unpack>(
        row: &[u8],
        groups: usize,
        x: &QActs,
        r0: usize,
        out: &mut [f32],
    ) {
        if avx512::available() {
            check_int(
                U::FORMAT,
                row,
                groups,
                x,
                r0,
                out.len(),
                super::super::INT_ROWS,
            );
            // SAFETY: the CPU has the AVX-512 features the kernel needs (checked at run time);
            // the lengths were checked above.
            unsafe { avx512::int_rows::<U>(row.as_ptr(), groups, x, r0, out) };
        } else {
            int_rows_avx2::<U>(row, groups, x, r0, out);
        }
    }

    /// The one-row pick of `U` on this CPU (`super::super::pick`: measured once per format):
    /// None without AVX-512 (there is no other kernel to choose) or for a format without a
    /// one-row kernel.
    pub(super) fn one_row_pick<U: Unpack>() -> Option<super::super::pick::Pick> {
        let bb = U::FLAT?;
        if !avx512::available() || super::super::pick::mode() == OneRow::Invariant {
            return None;
        }
        debug_assert_eq!(bb, U::FORMAT.block_bytes());
        Some(super::super::pick::one_row(
            index(U::FORMAT),
            |d, g, x| {
                super::super::pick::pass(d, g, x, bb, |row, x, out| {
                    check_int(U::FORMAT, row, g, x, 0, 1, super::super::INT_ROWS);
                    // SAFETY: AVX-512 VNNI is available (checked above); the lengths were
                    // checked on the line before.
                    unsafe { avx512::int_rows::<U>(row.as_ptr(), g, x, 0, out) }
                })
            },
            |d, g, x| {
                super::super::pick::pass(d, g, x, bb, |row, x, out| {
                    check_int(U::FORMAT, row, g, x, 0, 1, 8);
                    // SAFETY: AVX2 and FMA (the build's target); lengths checked on the line
                    // before; `U` is flat.
                    unsafe { avx2::dot_int_flat::<U>(row.as_ptr(), g, x, 0, out) }
                })
            },
            U::FORMAT,
        ))
    }

    /// The kernel of a one-row product of `U`: AVX2's where it measured clearly faster than
    /// AVX-512's on this CPU, else [`int_rows`]. Chosen once per product, not per weight row.
    pub(super) fn one_row_kernel<U: Unpack>() -> IntKernel {
        if one_row_pick::<U>().is_some_and(|p| p.avx2) {
            int_rows_avx2::<U>
        } else {
            int_rows::<U>
        }
    }

    /// [`int_rows`] on AVX2 whatever the CPU has beyond it.
    pub(super) fn int_rows_avx2<U: Unpack>(
        row: &[u8],
        groups: usize,
        x: &QActs,
        r0: usize,
        out: &mut [f32],
    ) {
        let g = out.len();
        check_int(U::FORMAT, row, groups, x, r0, g, 8);
        let p = row.as_ptr();
        // SAFETY: the build targets x86-64-v3 (AVX2, FMA); the lengths were checked above.
        unsafe {
            match g {
                // The one-row kernel's bits differ from a row's in a larger tile: only where
                // a one-row kernel was asked for (not batch-invariant).
                1 if U::FLAT.is_some() && super::super::pick::mode() != OneRow::Invariant => {
                    avx2::dot_int_flat::<U>(p, groups, x, r0, out)
                }
                1 => avx2::dot_int::<U, 1>(p, groups, x, r0, out),
                2 => avx2::dot_int::<U, 2>(p, groups, x, r0, out),
                3 => avx2::dot_int::<U, 3>(p, groups, x, r0, out),
                4 => avx2::dot_int::<U, 4>(p, groups, x, r0, out),
                5 => avx2::dot_int::<U, 5>(p, groups, x, r0, out),
                6 => avx2::dot_int::<U, 6>(p, groups, x, r0, out),
                7 => avx2::dot_int::<U, 7>(p, groups, x, r0, out),
                _ => avx2::dot_int::<U, 8>(p, groups, x, r0, out),
            }
        }
    }

    pub(super) fn f32_rows<const F: u8>(
        row: &[u8],
        groups: usize,
        x: &[f32],
        r0: usize,
        out: &mut [f32],
    ) {
        let f = FORMATS[F as usize];
        let g = out.len();
        let cols = groups * GROUP;
        check(f, row, groups, end(r0, g, cols), x.len(), g);
        assert!(g <= super::super::F32_ROWS);
        let p = row.as_ptr();
        // Monomorphized per format: the loader inlines into the kernel.
        macro_rules! go {
            ($load:expr) => {{
                // SAFETY: the build targets x86-64-v3 (AVX-512 only where the CPU has it);
                // the loader reads within the row for every group (row length checked
                // above), and the activation rows exist.
                unsafe {
                    let l = |j| $load(p, j);
                    match g {
                        _ if avx512::available() => avx512::f32_rows(l, groups, x, r0, out),
                        5.. => unreachable!("AVX2 passes take at most 4 rows"),
                        1 => avx2::dot_f32::<1>(l, groups, x, r0, out),
                        2 => avx2::dot_f32::<2>(l, groups, x, r0, out),
                        3 => avx2::dot_f32::<3>(l, groups, x, r0, out),
                        _ => avx2::dot_f32::<4>(l, groups, x, r0, out),
                    }
                }
            }};
        }
        with_loader!(f, go)
    }
}

/// The formats by index, for const-generic kernel selection.
const FORMATS: [Format; 7] = [
    Format::F32,
    Format::F16,
    Format::Q4_0,
    Format::Q4_1,
    Format::Q8_0,
    Format::Q4K,
    Format::Q6K,
];

fn index(f: Format) -> usize {
    FORMATS.iter().position(|&g| g == f).expect("listed")
}

/// The integer-product kernel of an integer format.
pub(crate) fn int_kernel(f: Format) -> IntKernel {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        use super::avx2;
        match f {
            Format::Q4_0 => simd::int_rows::<avx2::Q4_0>,
            Format::Q4_1 => simd::int_rows::<avx2::Q4_1>,
            Format::Q8_0 => simd::int_rows::<avx2::Q8_0>,
            Format::Q4K => simd::int_rows::<avx2::Q4K>,
            Format::Q6K => simd::int_rows::<avx2::Q6K>,
            Format::F32 | Format::F16 => unreachable!("{} takes f32 activations", f.name()),
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let _ = index(f);
        match f {
            Format::Q4_0 => scalar_int::<2>,
            Format::Q4_1 => scalar_int::<3>,
            Format::Q8_0 => scalar_int::<4>,
            Format::Q4K => scalar_int::<5>,
            Format::Q6K => scalar_int::<6>,
            Format::F32 | Format::F16 => unreachable!("{} takes f32 activations", f.name()),
        }
    }
}

/// The one-row pick of flat format `f` ([`super::pick`]), measured now if not yet; None where
/// there is nothing to pick (no AVX-512, or a format without a one-row kernel).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) fn one_row_pick(f: Format) -> Option<super::pick::Pick> {
    use super::avx2;
    match f {
        Format::Q4_0 => simd::one_row_pick::<avx2::Q4_0>(),
        Format::Q4_1 => simd::one_row_pick::<avx2::Q4_1>(),
        Format::Q8_0 => simd::one_row_pick::<avx2::Q8_0>(),
        _ => None,
    }
}

/// The integer kernel for a product of `n` activation rows: [`int_kernel`], except that a
/// one-row product of a flat format may take AVX2's one-row kernel (`simd::one_row_kernel`).
pub(crate) fn int_kernel_for(f: Format, n: usize) -> IntKernel {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if n == 1 {
        use super::avx2;
        match f {
            Format::Q4_0 => return simd::one_row_kernel::<avx2::Q4_0>(),
            Format::Q4_1 => return simd::one_row_kernel::<avx2::Q4_1>(),
            Format::Q8_0 => return simd::one_row_kernel::<avx2::Q8_0>(),
            _ => {}
        }
    }
    let _ = n;
    int_kernel(f)
}

/// The AVX2 integer kernel even where AVX-512 is picked (tests compare the two).
#[cfg(all(
    test,
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) fn int_kernel_avx2(f: Format) -> IntKernel {
    use super::avx2;
    match f {
        Format::Q4_0 => simd::int_rows_avx2::<avx2::Q4_0>,
        Format::Q4_1 => simd::int_rows_avx2::<avx2::Q4_1>,
        Format::Q8_0 => simd::int_rows_avx2::<avx2::Q8_0>,
        Format::Q4K => simd::int_rows_avx2::<avx2::Q4K>,
        Format::Q6K => simd::int_rows_avx2::<avx2::Q6K>,
        Format::F32 | Format::F16 => unreachable!("{} takes f32 activations", f.name()),
    }
}

/// The f32-activation kernel of a format (its own order of operations; see
/// [`super::QMatrix::matmul_f32`]).
pub(crate) fn f32_kernel(f: Format) -> F32Kernel {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        match index(f) {
            0 => simd::f32_rows::<0>,
            1 => simd::f32_rows::<1>,
            2 => simd::f32_rows::<2>,
            3 => simd::f32_rows::<3>,
            4 => simd::f32_rows::<4>,
            5 => simd::f32_rows::<5>,
            _ => simd::f32_rows::<6>,
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        match index(f) {
            0 => scalar_f32::<0>,
            1 => scalar_f32::<1>,
            2 => scalar_f32::<2>,
            3 => scalar_f32::<3>,
            4 => scalar_f32::<4>,
            5 => scalar_f32::<5>,
            _ => scalar_f32::<6>,
        }
    }
}

/// Packs weight rows `rows` (1 to [`PANEL`], rows of `groups` groups of `f`) into `panel`
/// transposed and dequantized: `panel[k · PANEL + i]` is row `i`'s weight `k`. Columns past
/// the rows given hold copies of the last row (their products are not used).
pub(crate) fn pack_panel(f: Format, rows: &[&[u8]], groups: usize, panel: &mut [f32]) {
    let cols = groups * GROUP;
    assert!(!rows.is_empty() && rows.len() <= PANEL && panel.len() == cols * PANEL);
    for r in rows {
        check(f, r, groups, Some(0), 0, 1);
    }
    let row = |i: usize| rows[i.min(rows.len() - 1)];
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        use super::avx2;
        let out = panel.as_mut_ptr();
        for c0 in (0..rows.len()).step_by(8) {
            let p: [*const u8; 8] = std::array::from_fn(|i| row(c0 + i).as_ptr());
            macro_rules! go {
                ($load:expr) => {
                    // SAFETY: x86-64-v3 build; every row holds `groups` groups (checked
                    // above), the panel cols · PANEL floats, and c0 + 8 ≤ PANEL.
                    unsafe { avx2::pack8(|r, j| $load(r, j), p, groups, out, c0) }
                };
            }
            with_loader!(f, go)
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let mut g = [0f32; GROUP];
        for i in 0..rows.len().next_multiple_of(8).min(PANEL) {
            for j in 0..groups {
                format::group_f32(f, row(i), j, &mut g);
                for (kk, &v) in g.iter().enumerate() {
                    panel[(j * GROUP + kk) * PANEL + i] = v;
                }
            }
        }
    }
}

/// `out[r][c] = Σ_k x[r][k] · panel[k][c]` for the `n` rows of `x` (rows of `cols`) and the
/// panel's 32 columns (`out` rows of 32): one FMA per k in order for every output.
pub(crate) fn panel_product(x: &[f32], cols: usize, panel: &[f32], out: &mut [f32]) {
    let n = x.len() / cols;
    assert!(x.len() == n * cols && panel.len() == cols * PANEL && out.len() == n * PANEL);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        use super::{avx2, avx512};
        let wide = avx512::available();
        let step = if wide { avx512::PANEL_ROWS } else { 6 };
        let mut r = 0;
        while r < n {
            let g = (n - r).min(step);
            let (xp, pp, op) = (
                x[r * cols..].as_ptr(),
                panel.as_ptr(),
                out[r * PANEL..].as_mut_ptr(),
            );
            // SAFETY: x86-64-v3 build, AVX-512 only where the CPU has it; rows r..r + g of
            // `x` and `out` exist, the panel holds cols · 32 floats (checked above).
            unsafe {
                if wide {
                    avx512::panel_rows(g, xp, cols, pp, op, PANEL);
                } else {
                    match g {
                        1 => avx2::panel_rows::<1>(xp, cols, pp, op, PANEL),
                        2 => avx2::panel_rows::<2>(xp, cols, pp, op, PANEL),
                        3 => avx2::panel_rows::<3>(xp, cols, pp, op, PANEL),
                        4 => avx2::panel_rows::<4>(xp, cols, pp, op, PANEL),
                        5 => avx2::panel_rows::<5>(xp, cols, pp, op, PANEL),
                        _ => avx2::panel_rows::<6>(xp, cols, pp, op, PANEL),
                    }
                }
            }
            r += g;
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for (xr, o) in x.chunks_exact(cols).zip(out.chunks_exact_mut(PANEL)) {
        o.fill(0.0);
        for (k, &v) in xr.iter().enumerate() {
            for (c, oc) in o.iter_mut().enumerate() {
                *oc = v.mul_add(panel[k * PANEL + c], *oc);
            }
        }
    }
}

/// Dequantizes a row of `groups` groups into `out`.
pub(crate) fn row_f32(f: Format, row: &[u8], groups: usize, out: &mut [f32]) {
    check(f, row, groups, Some(groups * GROUP), out.len(), 1);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        let p = row.as_ptr();
        macro_rules! go {
            ($load:expr) => {
                // SAFETY: x86-64-v3 build; the row holds `groups` groups and `out` as many
                // values (checked above).
                unsafe { super::avx2::row_f32(|j| $load(p, j), groups, out) }
            };
        }
        with_loader!(f, go)
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for (j, o) in out[..groups * GROUP].chunks_exact_mut(GROUP).enumerate() {
        format::group_f32(f, row, j, o);
    }
}

#[allow(dead_code)]
fn scalar_int<const F: u8>(row: &[u8], groups: usize, x: &QActs, r0: usize, out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = format::dot_int(FORMATS[F as usize], row, x, (r0 + r) * groups, groups);
    }
}

#[allow(dead_code)]
fn scalar_f32<const F: u8>(row: &[u8], groups: usize, x: &[f32], r0: usize, out: &mut [f32]) {
    let cols = groups * GROUP;
    for (r, o) in out.iter_mut().enumerate() {
        let xr = &x[(r0 + r) * cols..(r0 + r + 1) * cols];
        *o = format::dot_f32(FORMATS[F as usize], row, xr);
    }
}
