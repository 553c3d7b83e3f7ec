//! The matmul seam: every weight-by-activation product in the model goes through [`QLinear`].
//!
//! A `QLinear` owns one weight matrix and an optional bias. Which kernel runs is decided here,
//! per tensor type: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K are repacked at load into this
//! crate's panel layout and multiplied by [`quant`]'s integer kernels (AVX-512 VNNI, AVX2 or
//! scalar, picked at run time); f16 weights use [`f16mm`]'s AVX-512 or AVX2 product where the
//! CPU has one, other float weights candle's GEMM; other ggml types stay on candle's quantized
//! kernels.

pub mod cpu;
pub mod f16mm;
pub mod fastmath;
pub mod mem;
pub mod pool;
pub mod prof;
pub mod quant;
pub mod tap;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use prof::Part;
use quant::PackedWeight;

pub type Result<T> = candle_core::Result<T>;

/// `SWITCHYARD_KERNELS=candle` keeps every quantized weight on candle's kernels (for
/// side-by-side comparisons); anything else uses this crate's kernels where they apply.
pub const KERNELS_ENV: &str = "SWITCHYARD_KERNELS";

fn candle_only() -> bool {
    static CANDLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CANDLE.get_or_init(|| std::env::var(KERNELS_ENV).is_ok_and(|v| v == "candle"))
}

/// Whether f16 weights use [`f16mm`] (AVX-512 and AVX2 CPUs) rather than candle's f16 GEMM.
fn half_kernel() -> bool {
    cpu::simd_level() != cpu::SimdLevel::Scalar && !candle_only()
}

/// Bytes an `[n, k]` f16 weight takes on the kernel [`QLinear::dense`] picks for it.
pub fn planned_f16_bytes(n: usize, k: usize) -> usize {
    if half_kernel() {
        f16mm::HalfWeight::planned_bytes(n, k)
    } else {
        2 * n * k
    }
}

#[derive(Debug, Clone)]
enum Kernel {
    Packed(Arc<PackedWeight>),
    Half(Arc<f16mm::HalfWeight>),
    Candle(QMatMul),
}

/// `f(x's values in row-major order)`, read in place where `x` is a contiguous f32 CPU tensor
/// (what the model's layers pass), else from a converted copy: a copy of every product's
/// input was a twentieth of a batched decode step.
pub fn with_values<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    use candle_core::{CpuStorage, Storage};
    let x = x.contiguous()?.to_dtype(DType::F32)?;
    {
        let (storage, layout) = x.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&v[a..b]));
        }
    }
    let v = {
        let _copy = prof::time(Part::Copy);
        x.flatten_all()?.to_vec1::<f32>()?
    };
    Ok(f(&v))
}

/// `x + y` for f32 tensors of one shape, on the caller's thread. Candle splits element-wise ops
/// of 64K elements or more over a thread pool of its own, whose workers then compete with
/// [`pool`]'s for the same cores: in one run at batch 187 the residual adds took 35 ms per
/// decode step that way, 2.8 ms here (how much it costs varies from run to run). Addition is elementwise, so the bits equal candle's. Other dtypes and
/// shapes go to candle.
pub fn add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.dims() != y.dims() || x.dtype() != DType::F32 || y.dtype() != DType::F32 {
        return x + y;
    }
    let out = elementwise([x, y], x.elem_count(), |[a, b], out| {
        for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    })?;
    Tensor::from_vec(out, x.shape(), x.device())
}

/// `y + bias` with `bias` (one value per column) added to every row of `y`, on the caller's
/// thread for the reason [`add`] gives. Same bits as candle's `broadcast_add`.
pub fn add_bias(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let cols = bias.elem_count();
    let fits = bias.rank() == 1
        && y.dims().last() == Some(&cols)
        && y.dtype() == DType::F32
        && bias.dtype() == DType::F32;
    if !fits {
        return y.broadcast_add(bias);
    }
    let out = elementwise([y, bias], y.elem_count(), |[v, b], out| {
        for (o, v) in out.chunks_exact_mut(cols).zip(v.chunks_exact(cols)) {
            for ((o, v), b) in o.iter_mut().zip(v).zip(b) {
                *o = v + b;
            }
        }
    })?;
    Tensor::from_vec(out, y.shape(), y.device())
}

/// `f(the inputs' values, output of len values)` over the inputs as contiguous f32 CPU
/// tensors, read in place (no copy for the contiguous f32 tensors the projections give): the
/// elementwise kernels of [`fastmath`] and the sums below without candle's intermediate
/// tensors.
pub fn elementwise<const N: usize>(
    inputs: [&Tensor; N],
    len: usize,
    f: impl FnOnce([&[f32]; N], &mut [f32]),
) -> Result<Vec<f32>> {
    use candle_core::{CpuStorage, Storage};
    let owned = inputs
        .iter()
        .map(|t| t.contiguous()?.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<Tensor>>>()?;
    let guards: Vec<_> = owned.iter().map(Tensor::storage_and_layout).collect();
    let mut values: [&[f32]; N] = [&[]; N];
    for (v, (storage, layout)) in values.iter_mut().zip(&guards) {
        match (&**storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(all)), Some((a, b))) => *v = &all[a..b],
            _ => {
                return Err(candle_core::Error::Msg(
                    "elementwise kernels run on CPU tensors".into(),
                ))
            }
        }
    }
    let mut out = vec![0f32; len];
    f(values, &mut out);
    Ok(out)
}

/// `x * ws[i]^T` for every weight (`widths[i]` outputs each, `rows` rows of `x`), into fresh
/// vectors that are not zeroed first: the kernel writes every element.
fn products(
    ws: &[&PackedWeight],
    widths: &[usize],
    x: &Tensor,
    rows: usize,
    part: Part,
) -> Result<Vec<Vec<f32>>> {
    let mut outs: Vec<Vec<f32>> = widths
        .iter()
        .map(|&n| Vec::with_capacity(rows * n))
        .collect();
    with_values(x, |xs| {
        let mut views: Vec<&mut [std::mem::MaybeUninit<f32>]> = outs
            .iter_mut()
            .zip(widths)
            .map(|(o, &n)| &mut o.spare_capacity_mut()[..rows * n])
            .collect();
        quant::matmul_many_uninit_as(ws, xs, rows, &mut views, part)
    })?;
    for (o, &n) in outs.iter_mut().zip(widths) {
        // SAFETY: the capacity is `rows * n`, and `matmul_many_uninit_as` returned, having
        // written all `rows * n` values of this output.
        unsafe { o.set_len(rows * n) };
    }
    Ok(outs)
}

/// Several layers' outputs as row-major values (one vector per layer), with the input's
/// leading dimensions.
pub type Products = (Vec<Vec<f32>>, Vec<usize>);

/// A linear layer `y = x W^T + b` whose weight `W` is `[out_features, in_features]`.
/// Cloning shares the weight (tied embeddings and LM head hold one copy).
#[derive(Debug, Clone)]
pub struct QLinear {
    kernel: Kernel,
    bias: Option<Tensor>,
    dtype: GgmlDType,
    out_features: usize,
    in_features: usize,
    resident_bytes: usize,
    span: tracing::Span,
    /// The weight's canonical name, when the loader gave one (for [`tap`]).
    name: Option<Arc<str>>,
}

impl QLinear {
    /// The weight in its stored type, on the fastest kernel for that type.
    pub fn new(weight: QTensor, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let dtype = weight.dtype();
        let on_cpu = weight.device().is_cpu();
        let packed = if on_cpu && !candle_only() {
            PackedWeight::from_qtensor(&weight)?
        } else {
            None
        };
        let kernel = match packed {
            Some(p) => Kernel::Packed(Arc::new(p)),
            // Built directly rather than with `QMatMul::from_arc`, which consults the
            // process-wide CANDLE_DEQUANTIZE_ALL variables: the kernel choice belongs here.
            _ => Kernel::Candle(match dtype {
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                    QMatMul::Tensor(weight.dequantize(&weight.device())?.to_dtype(DType::F32)?)
                }
                _ => QMatMul::QTensor(Arc::new(weight)),
            }),
        };
        Self::from_parts(kernel, bias, dtype, out_features, in_features)
    }

    /// Dequantizes the weight to a dense `dtype` (F32 or F16) matrix and uses GEMM: the
    /// precision baseline, with no activation quantization.
    pub fn dense(weight: &QTensor, dtype: DType, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let stored = weight.dtype();
        let w = weight.dequantize(&weight.device())?.to_dtype(dtype)?;
        if dtype == DType::F16 && w.device().is_cpu() && half_kernel() {
            let values = w.flatten_all()?.to_vec1::<half::f16>()?;
            let h = f16mm::HalfWeight::new(&values, out_features, in_features)?;
            return Self::from_parts(
                Kernel::Half(Arc::new(h)),
                bias,
                stored,
                out_features,
                in_features,
            );
        }
        let inner = match dtype {
            DType::F16 => QMatMul::TensorF16(w),
            _ => QMatMul::Tensor(w),
        };
        Self::from_parts(
            Kernel::Candle(inner),
            bias,
            stored,
            out_features,
            in_features,
        )
    }

    fn from_parts(
        kernel: Kernel,
        bias: Option<Tensor>,
        dtype: GgmlDType,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self> {
        if let Some(b) = &bias {
            let n = b.dims1()?;
            if n != out_features {
                candle_core::bail!("bias has {n} values for {out_features} outputs");
            }
        }
        let weight_bytes = match &kernel {
            Kernel::Packed(p) => p.bytes(),
            Kernel::Half(h) => h.bytes(),
            Kernel::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Kernel::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        };
        let resident_bytes = weight_bytes
            + bias
                .as_ref()
                .map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes());
        let span = tracing::trace_span!("qlinear", out = out_features, inp = in_features);
        Ok(Self {
            kernel,
            bias,
            dtype,
            out_features,
            in_features,
            resident_bytes,
            span,
            name: None,
        })
    }

    /// Names the layer (its weight's canonical name), so a [`tap`] can observe its input.
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(Arc::from(name));
        self
    }

    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn observe(&self, x: &Tensor) {
        if let Some(name) = &self.name {
            tap::observe(name, x);
        }
    }

    /// `x`: `[.., in_features]` f32. Returns `[.., out_features]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_as(x, self.part())
    }

    /// [`QLinear::forward`], its time counted as `part` in the profile (the LM head, whose
    /// weight may be the embedding's).
    pub fn forward_as(&self, x: &Tensor, part: Part) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.observe(x);
        let y = match &self.kernel {
            Kernel::Packed(p) => {
                let (mut dims, rows) = self.leading_dims(x)?;
                let out = products(&[&**p], &[self.out_features], x, rows, part)?.remove(0);
                dims.push(self.out_features);
                let _copy = prof::time(Part::Copy);
                Tensor::from_vec(out, dims, x.device())?
            }
            Kernel::Half(h) => {
                let (mut dims, rows) = self.leading_dims(x)?;
                let n = self.out_features;
                let mut out: Vec<f32> = Vec::with_capacity(rows * n);
                with_values(x, |xs| {
                    h.matmul_uninit_as(xs, rows, &mut out.spare_capacity_mut()[..rows * n], part)
                })?;
                // SAFETY: the capacity is `rows * n` and the product wrote every value.
                unsafe { out.set_len(rows * n) };
                dims.push(n);
                let _copy = prof::time(Part::Copy);
                Tensor::from_vec(out, dims, x.device())?
            }
            Kernel::Candle(q) => {
                let _t = prof::time(part);
                let y = q.forward(x)?;
                if y.dtype() == DType::F32 {
                    y
                } else {
                    y.to_dtype(DType::F32)?
                }
            }
        };
        match &self.bias {
            Some(b) => {
                let _t = prof::time(Part::Residual);
                add_bias(&y, b)
            }
            None => Ok(y),
        }
    }

    /// `x`'s leading dimensions and their product (the rows), after checking that its last
    /// dimension is the layer's input width.
    fn leading_dims(&self, x: &Tensor) -> Result<(Vec<usize>, usize)> {
        let mut dims = x.dims().to_vec();
        let k = dims.pop().unwrap_or(0);
        if k != self.in_features {
            candle_core::bail!(
                "input has {k} features, the layer takes {}",
                self.in_features
            );
        }
        let rows = dims.iter().product();
        Ok((dims, rows))
    }

    /// The profile part this layer's products count in.
    fn part(&self) -> Part {
        Part::of_weight(self.name())
    }

    /// `[layer.forward(x) for layer in layers]`, bit for bit, computed together where the
    /// kernels allow (see [`quant::matmul_many`]): a layer's q/k/v or gate/up projections.
    pub fn forward_many(layers: &[&QLinear], x: &Tensor) -> Result<Vec<Tensor>> {
        let Some((outs, dims)) = Self::products_together(layers, x)? else {
            return layers.iter().map(|l| l.forward(x)).collect();
        };
        layers
            .iter()
            .zip(outs)
            .map(|(l, out)| {
                let mut shape = dims.clone();
                shape.push(l.out_features);
                let y = {
                    let _t = prof::time(Part::Copy);
                    Tensor::from_vec(out, shape, x.device())?
                };
                match &l.bias {
                    Some(b) => {
                        let _t = prof::time(Part::Residual);
                        add_bias(&y, b)
                    }
                    None => Ok(y),
                }
            })
            .collect()
    }

    /// The products of [`QLinear::forward_many`] as row-major values, with the input's leading
    /// dimensions, where they are computed together (every layer packed, none with a bias):
    /// for a caller that transforms them in place, such as the gated MLP's activation. `None`
    /// where [`QLinear::forward_many`] would compute them one by one.
    pub fn forward_many_values(layers: &[&QLinear], x: &Tensor) -> Result<Option<Products>> {
        if layers.iter().any(|l| l.bias.is_some()) {
            return Ok(None);
        }
        Self::products_together(layers, x)
    }

    /// Every layer's product before its bias, computed together, and the input's leading
    /// dimensions; `None` unless there are several layers, all packed, and no tap observes
    /// them (a tap needs each layer's own call).
    fn products_together(layers: &[&QLinear], x: &Tensor) -> Result<Option<Products>> {
        let packed: Option<Vec<&PackedWeight>> = layers
            .iter()
            .map(|l| match &l.kernel {
                Kernel::Packed(p) => Some(&**p),
                Kernel::Half(_) | Kernel::Candle(_) => None,
            })
            .collect();
        let Some(ws) = packed.filter(|ws| ws.len() > 1 && !tap::active()) else {
            return Ok(None);
        };
        let mut dims = x.dims().to_vec();
        let k = dims.pop().unwrap_or(0);
        if let Some(l) = layers.iter().find(|l| l.in_features != k) {
            candle_core::bail!("input has {k} features, the layer takes {}", l.in_features);
        }
        let _enter = layers[0].span.enter();
        let rows: usize = dims.iter().product();
        let widths: Vec<usize> = layers.iter().map(|l| l.out_features).collect();
        let outs = products(&ws, &widths, x, rows, layers[0].part())?;
        Ok(Some((outs, dims)))
    }

    /// Rows `ids` of the weight as f32 `[ids.len(), in_features]` (an embedding lookup),
    /// dequantized exactly as ggml does.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let k = self.in_features;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.out_features) {
            candle_core::bail!("row {bad} of a {}-row matrix", self.out_features);
        }
        match &self.kernel {
            Kernel::Packed(p) => {
                let mut out = vec![0f32; ids.len() * k];
                for (i, &id) in ids.iter().enumerate() {
                    p.dequantize_row(id as usize, &mut out[i * k..(i + 1) * k]);
                }
                Tensor::from_vec(out, (ids.len(), k), &candle_core::Device::Cpu)
            }
            Kernel::Half(h) => {
                let mut out = vec![0f32; ids.len() * k];
                for (i, &id) in ids.iter().enumerate() {
                    h.dequantize_row(id as usize, &mut out[i * k..(i + 1) * k]);
                }
                Tensor::from_vec(out, (ids.len(), k), &candle_core::Device::Cpu)
            }
            Kernel::Candle(q) => {
                let device = match q {
                    QMatMul::QTensor(t) => t.device(),
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.device().clone(),
                };
                let ids = Tensor::new(ids, &device)?;
                q.embedding(&ids)?.to_dtype(DType::F32)
            }
        }
    }

    /// The weight's stored type (before any repacking or dequantization for the kernel).
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Bytes this layer keeps in memory (weight as held for its kernel, plus bias).
    pub fn resident_bytes(&self) -> usize {
        self.resident_bytes
    }

    /// Bytes [`QLinear::new`] will hold for a weight of `dtype` and `shape` `[n, k]` (without
    /// bias), so residency can be planned before loading.
    pub fn planned_bytes(dtype: GgmlDType, shape: &[usize]) -> usize {
        let elems: usize = shape.iter().product();
        match (dtype, shape) {
            (GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16, _) => elems * 4,
            (_, &[n, k]) => PackedWeight::planned_bytes(dtype, n, k)
                .unwrap_or(elems / dtype.block_size() * dtype.type_size()),
            _ => elems / dtype.block_size() * dtype.type_size(),
        }
    }

    /// Name of the kernel family serving this layer (for reports).
    pub fn kernel_name(&self) -> &'static str {
        match &self.kernel {
            Kernel::Packed(_) | Kernel::Half(_) => "switchyard",
            Kernel::Candle(_) => "candle",
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};

    use super::*;

    fn layer(n: usize, k: usize, seed: u64, bias: bool) -> QLinear {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let w = Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        let b = bias.then(|| Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap());
        QLinear::new(q, b).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn sums_on_the_callers_thread_equal_candles() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        // 187 x 576 is over candle's 64K-element threshold for its own pool; 3 x 576 is under.
        for rows in [3, 187] {
            let mut values =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect() };
            let x = Tensor::from_vec(values(rows * 576), (rows, 576), &Device::Cpu).unwrap();
            let h = Tensor::from_vec(values(rows * 576), (rows, 576), &Device::Cpu).unwrap();
            let b = Tensor::from_vec(values(576), 576, &Device::Cpu).unwrap();
            assert_eq!(bits(&add(&x, &h).unwrap()), bits(&(&x + &h).unwrap()));
            assert_eq!(
                bits(&add_bias(&x, &b).unwrap()),
                bits(&x.broadcast_add(&b).unwrap())
            );
            // A view that is not contiguous reads through a copy, with the same result.
            let t = x.t().unwrap();
            let th = h.t().unwrap();
            assert_eq!(bits(&add(&t, &th).unwrap()), bits(&(&t + &th).unwrap()));
            assert_eq!(add(&t, &th).unwrap().dims(), [576, rows]);
        }
        // Shapes that do not match are candle's error, not a panic.
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let y = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(add(&x, &y).is_err());
        let wrong_bias = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(add_bias(&x, &wrong_bias).is_err());
    }

    #[test]
    fn products_into_unzeroed_outputs_equal_the_weights_own_product() {
        // A ragged last panel (300 = 18 * 16 + 12 outputs) and 11 rows (a partial row tile).
        let (gate, up) = (layer(300, 512, 1, false), layer(300, 512, 2, false));
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let xs: Vec<f32> = (0..11 * 512)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let x = Tensor::from_vec(xs.clone(), (11, 512), &Device::Cpu).unwrap();
        for (l, seed) in [(&gate, 1), (&up, 2)] {
            let Kernel::Packed(p) = &l.kernel else {
                panic!("a Q4_K weight is packed")
            };
            // The product into an output filled with NaN: every element must be overwritten.
            let mut want = vec![f32::NAN; 11 * 300];
            p.matmul(&xs, 11, &mut want);
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits(&l.forward(&x).unwrap()), want, "weight {seed}");
        }
        let (values, dims) = QLinear::forward_many_values(&[&gate, &up], &x)
            .unwrap()
            .expect("two packed layers without bias");
        assert_eq!(dims, [11]);
        let together = QLinear::forward_many(&[&gate, &up], &x).unwrap();
        for ((v, t), l) in values.iter().zip(&together).zip([&gate, &up]) {
            assert_eq!(t.dims(), [11, 300]);
            let v: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
            assert_eq!(v, bits(t));
            assert_eq!(bits(&l.forward(&x).unwrap()), bits(t));
        }
        // A bias is added after the product: such layers have no values of their own.
        let biased = layer(300, 512, 4, true);
        assert!(QLinear::forward_many_values(&[&gate, &biased], &x)
            .unwrap()
            .is_none());
    }
}
