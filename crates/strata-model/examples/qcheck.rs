use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
fn main() {
    let w = Tensor::randn(0f32, 0.05, (192, 576), &Device::Cpu).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, 576), &Device::Cpu).unwrap();
    let q = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()).unwrap();
    let a = x.matmul(&w.t().unwrap()).unwrap();
    let b = q.forward(&x).unwrap();
    let d = (a.clone() - b.clone())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let m = a
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    println!("shape {:?} {:?} maxdiff {d} maxabs {m}", a.dims(), b.dims());
}
