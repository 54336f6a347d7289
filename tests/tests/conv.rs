//! The conv op's backward (forward convs only) against candle's built-in conv2d backward.

use candle_core::{Device, Tensor, Var};
use integration_tests::rel_l2;

fn grads(x: &Tensor, w: &Tensor, stride: usize, pad: usize, ours: bool) -> (Tensor, Vec<f32>, Vec<f32>) {
    let xv = Var::from_tensor(x).unwrap();
    let wv = Var::from_tensor(w).unwrap();
    let y = if ours {
        kernels::conv2d(xv.as_tensor(), wv.as_tensor(), stride, pad, kernels::ConvImpl::FwdConv).unwrap()
    } else {
        xv.as_tensor().conv2d(wv.as_tensor(), pad, stride, 1, 1).unwrap()
    };
    let g = Tensor::randn(0f32, 1., y.dims(), &Device::Cpu).unwrap();
    // Same upstream gradient for both paths: seed from the shape.
    let g = (g.zeros_like().unwrap() + (y.ones_like().unwrap() * 0.5).unwrap())
        .unwrap()
        .broadcast_mul(&Tensor::arange(0f32, y.dim(3).unwrap() as f32, &Device::Cpu).unwrap().sin().unwrap())
        .unwrap();
    let loss = (&y * &g).unwrap().sum_all().unwrap();
    let gs = loss.backward().unwrap();
    let gx = gs.get(xv.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let gw = gs.get(wv.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    (y, gx, gw)
}

#[test]
fn conv_backward_matches_candle() {
    let d = Device::Cpu;
    // (n, c_in, h, w, c_out, k, stride, pad): ResNet's kinds and awkward sizes. (candle's own backward takes the
    // output padding of both dims from the height, so the reference is wrong for inputs like 10x11 at stride 2:
    // non-square cases here keep both dims of the same parity.)
    let cases = [
        (2, 3, 17, 15, 8, 7, 2, 3),
        (2, 8, 9, 9, 4, 3, 1, 1),
        (1, 8, 10, 10, 6, 3, 2, 1),
        (1, 4, 11, 9, 6, 3, 2, 1),
        (2, 8, 8, 8, 16, 1, 1, 0),
        (2, 8, 9, 7, 16, 1, 2, 0),
        (3, 5, 6, 6, 7, 3, 2, 1),
    ];
    for (n, ci, h, w, co, k, s, p) in cases {
        let x = Tensor::randn(0f32, 1., (n, ci, h, w), &d).unwrap();
        let wt = Tensor::randn(0f32, 1., (co, ci, k, k), &d).unwrap();
        let (y1, gx1, gw1) = grads(&x, &wt, s, p, true);
        let (y2, gx2, gw2) = grads(&x, &wt, s, p, false);
        assert_eq!(y1.dims(), y2.dims());
        let (ex, ew) = (rel_l2(&gx1, &gx2), rel_l2(&gw1, &gw2));
        assert!(
            ex < 1e-5 && ew < 1e-5,
            "case {:?}: grad-input rel err {ex}, grad-weight {ew}",
            (n, ci, h, w, co, k, s, p)
        );
    }
}
