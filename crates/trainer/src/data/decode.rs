//! Decoding for the loader: the sample's crop is drawn from the header's dimensions, then a JPEG is decoded
//! straight to RGB (zune-jpeg) or, when the crop allows it, at 1/2, 1/4 or 1/8 scale in the DCT domain
//! (jpeg-decoder); other formats go through `image`. The result is rendered into the batch buffer.

use super::transforms::Transform;
use super::{one_line, DataError, StageNanos};
use rand::Rng;
use std::time::Instant;
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

pub fn is_jpeg(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0xFF, 0xD8, 0xFF])
}

/// What the frame header (SOFn) of a JPEG says: width, height, components, progressive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JpegHeader {
    pub width: u32,
    pub height: u32,
    pub components: u8,
    pub progressive: bool,
}

/// Reads the frame header by walking the markers (no decoding, no allocation); None when malformed or when the
/// height is deferred to a DNL marker.
pub fn jpeg_header(b: &[u8]) -> Option<JpegHeader> {
    if !is_jpeg(b) {
        return None;
    }
    let mut i = 2;
    loop {
        // Markers start with 0xFF, possibly padded with more 0xFF bytes.
        while *b.get(i)? == 0xFF {
            i += 1;
        }
        let m = *b.get(i)?;
        i += 1;
        match m {
            0xD8 | 0x01 | 0xD0..=0xD7 => continue,
            0xD9 | 0xDA => return None,
            _ => {}
        }
        let len = u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?]) as usize;
        if len < 2 {
            return None;
        }
        if matches!(m, 0xC0..=0xCF) && !matches!(m, 0xC4 | 0xC8 | 0xCC) {
            let seg = b.get(i + 2..i + len)?;
            let height = u16::from_be_bytes([*seg.get(1)?, *seg.get(2)?]) as u32;
            let width = u16::from_be_bytes([*seg.get(3)?, *seg.get(4)?]) as u32;
            let components = *seg.get(5)?;
            if width == 0 || height == 0 {
                return None;
            }
            return Some(JpegHeader { width, height, components, progressive: matches!(m, 0xC2 | 0xC6 | 0xCA | 0xCE) });
        }
        i += len;
    }
}

/// An RGB image decoded at 1/`scale` of the source's size.
pub struct Decoded {
    pub rgb: Vec<u8>,
    pub width: u32,
    pub height: u32,
    pub scale: u32,
}

fn zune_options() -> DecoderOptions {
    DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX)
        .jpeg_set_out_colorspace(ColorSpace::RGB)
}

/// Full-scale JPEG to RGB with zune-jpeg (SIMD IDCT and colour conversion).
pub fn decode_jpeg_full(bytes: &[u8]) -> Result<Decoded, String> {
    let mut rgb = Vec::new();
    let (width, height) = decode_jpeg_full_into(bytes, &mut rgb)?;
    Ok(Decoded { rgb, width, height, scale: 1 })
}

/// `decode_jpeg_full` into `rgb` (resized to fit; a buffer reused across images is not cleared first).
pub fn decode_jpeg_full_into(bytes: &[u8], rgb: &mut Vec<u8>) -> Result<(u32, u32), String> {
    let mut d = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), zune_options());
    d.decode_headers().map_err(|e| format!("{e:?}"))?;
    let (w, h) = d.dimensions().ok_or("no dimensions")?;
    let len = d.output_buffer_size().ok_or("no output size")?;
    if len != w * h * 3 {
        return Err(format!("{w}x{h} image decodes to {len} bytes, not RGB"));
    }
    rgb.resize(len, 0);
    d.decode_into(&mut rgb[..len]).map_err(|e| format!("{e:?}"))?;
    Ok((w as u32, h as u32))
}

thread_local! {
    /// Each loader thread's full-scale decoding buffer, kept across images (no allocation or zeroing per image).
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// JPEG to RGB at 1/`scale` (2, 4 or 8) through jpeg-decoder's reduced IDCT; None when that decoder cannot give
/// RGB (CMYK, 16-bit) or fails, so the caller falls back to full scale.
pub fn decode_jpeg_scaled(bytes: &[u8], hdr: &JpegHeader, scale: u32) -> Option<Decoded> {
    let run = || -> Option<Decoded> {
        let mut d = jpeg_decoder::Decoder::new(bytes);
        // Ask for exactly ceil(size * (8 / scale) / 8): jpeg-decoder then picks that IDCT size.
        let want = |v: u32| v.div_ceil(scale).min(u16::MAX as u32) as u16;
        let (w, h) = d.scale(want(hdr.width), want(hdr.height)).ok()?;
        if (w as u32, h as u32) != (want(hdr.width) as u32, want(hdr.height) as u32) {
            return None;
        }
        let px = d.decode().ok()?;
        let info = d.info()?;
        let n = w as usize * h as usize;
        let rgb = match info.pixel_format {
            jpeg_decoder::PixelFormat::RGB24 if px.len() == 3 * n => px,
            jpeg_decoder::PixelFormat::L8 if px.len() == n => px.iter().flat_map(|&v| [v, v, v]).collect(),
            _ => return None,
        };
        Some(Decoded { rgb, width: w as u32, height: h as u32, scale })
    };
    // A decoder bug must not take the loader down: treat a panic as "cannot", the full-scale path then reports.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).ok().flatten()
}

/// Loads one encoded image into `out` (size x size x 3, HWC) for `transform`: the plan is drawn from the header's
/// dimensions, the JPEG decoded at the coarsest scale the plan allows. Returns the flip. `name` names the sample
/// in errors.
pub fn load_into<R: Rng + ?Sized>(
    bytes: &[u8],
    name: &dyn Fn() -> String,
    transform: &Transform,
    rng: &mut R,
    out: &mut [u8],
    t: &mut StageNanos,
) -> Result<bool, DataError> {
    let err = |msg: String| DataError::Decode { path: name(), msg: one_line(&msg) };
    let t0 = Instant::now();
    let (plan, flip, img) = match jpeg_header(bytes) {
        Some(hdr) => {
            let (plan, flip) = transform.draw(hdr.width, hdr.height, rng);
            let k = transform.dct_scale(&plan);
            let scaled = if k > 1 { decode_jpeg_scaled(bytes, &hdr, k) } else { None };
            let img = match scaled {
                Some(d) => d,
                None => {
                    return SCRATCH.with(|buf| {
                        let mut buf = buf.borrow_mut();
                        let (w, h) = decode_jpeg_full_into(bytes, &mut buf).map_err(err)?;
                        if (w, h) != (hdr.width, hdr.height) {
                            return Err(err(format!("header says {}x{}, decoded {w}x{h}", hdr.width, hdr.height)));
                        }
                        let t1 = Instant::now();
                        transform.render(&plan, &buf, (w, h), 1, out).map_err(err)?;
                        t.decode += (t1 - t0).as_nanos() as u64;
                        t.augment += t1.elapsed().as_nanos() as u64;
                        Ok(flip)
                    });
                }
            };
            (plan, flip, img)
        }
        None => {
            let img = image::load_from_memory(bytes).map_err(|e| err(e.to_string()))?.into_rgb8();
            let (plan, flip) = transform.draw(img.width(), img.height(), rng);
            let (width, height) = img.dimensions();
            (plan, flip, Decoded { rgb: img.into_raw(), width, height, scale: 1 })
        }
    };
    let t1 = Instant::now();
    transform.render(&plan, &img.rgb, (img.width, img.height), img.scale, out).map_err(err)?;
    t.decode += (t1 - t0).as_nanos() as u64;
    t.augment += t1.elapsed().as_nanos() as u64;
    Ok(flip)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{GrayImage, Luma, Rgb, RgbImage};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn jpeg(img: &image::DynamicImage, quality: u8) -> Vec<u8> {
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality).encode_image(img).unwrap();
        out
    }

    /// A one-component (grayscale) JPEG.
    fn gray_jpeg(img: &GrayImage) -> Vec<u8> {
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 95)
            .encode(img.as_raw(), img.width(), img.height(), image::ExtendedColorType::L8)
            .unwrap();
        out
    }

    fn smooth(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            let (fx, fy) = (x as f32 / w as f32, y as f32 / h as f32);
            Rgb([(255.0 * fx) as u8, (255.0 * fy) as u8, (128.0 + 100.0 * (6.0 * fx + 4.0 * fy).sin()) as u8])
        })
    }

    #[test]
    fn header_dimensions_components_and_junk() {
        let b = jpeg(&smooth(37, 21).into(), 90);
        assert_eq!(jpeg_header(&b), Some(JpegHeader { width: 37, height: 21, components: 3, progressive: false }));
        let g = gray_jpeg(&GrayImage::from_pixel(5, 9, Luma([7])));
        assert_eq!(jpeg_header(&g).map(|h| (h.width, h.height, h.components)), Some((5, 9, 1)));
        assert_eq!(jpeg_header(b"\xFF\xD8\xFF\xE0\x00"), None);
        assert_eq!(jpeg_header(&b[..20]), None);
        assert_eq!(jpeg_header(b"GIF89a"), None);
    }

    #[test]
    fn grayscale_jpeg_decodes_to_rgb() {
        let g = gray_jpeg(&GrayImage::from_fn(16, 8, |x, _| Luma([(x * 16) as u8])));
        assert_eq!(jpeg_header(&g).unwrap().components, 1);
        let d = decode_jpeg_full(&g).unwrap();
        assert_eq!((d.width, d.height, d.rgb.len()), (16, 8, 16 * 8 * 3));
        assert!(d.rgb.chunks_exact(3).all(|p| p[0] == p[1] && p[1] == p[2]));
        let s = decode_jpeg_scaled(&g, &jpeg_header(&g).unwrap(), 2).unwrap();
        assert_eq!((s.width, s.height, s.rgb.len()), (8, 4, 8 * 4 * 3));
    }

    /// A large window decodes at a reduced scale and gives nearly what full-scale decoding + resizing gives.
    #[test]
    fn dct_scaled_decode_matches_full_scale() {
        let img = smooth(1000, 760);
        let bytes = jpeg(&img.clone().into(), 92);
        let hdr = jpeg_header(&bytes).unwrap();
        for k in [2, 4, 8] {
            let d = decode_jpeg_scaled(&bytes, &hdr, k).unwrap();
            assert_eq!((d.width, d.height, d.scale), (1000u32.div_ceil(k), 760u32.div_ceil(k), k));
        }
        // Validation at 64 (val_resize 72) of a 1000x760 image: a 676-pixel window, decodable at 1/8.
        let t = Transform { size: 64, val_resize: 72, augment: false };
        let (plan, _) = t.draw(1000, 760, &mut ChaCha8Rng::seed_from_u64(0));
        assert_eq!(t.dct_scale(&plan), 8);
        let mut fast = vec![0u8; 64 * 64 * 3];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let flip = load_into(&bytes, &|| "x".into(), &t, &mut rng, &mut fast, &mut StageNanos::default()).unwrap();
        assert!(!flip);
        let full = decode_jpeg_full(&bytes).unwrap();
        let mut slow = vec![0u8; 64 * 64 * 3];
        t.render(&plan, &full.rgb, (1000, 760), 1, &mut slow).unwrap();
        let mean = fast.iter().zip(&slow).map(|(a, b)| a.abs_diff(*b) as f64).sum::<f64>() / fast.len() as f64;
        assert!(mean < 2.0, "mean abs difference {mean}");
    }

    #[test]
    fn corrupt_and_truncated_images_name_the_file() {
        let bytes = jpeg(&smooth(64, 48).into(), 90);
        let t = Transform { size: 32, val_resize: 32, augment: true };
        let mut out = vec![0u8; 32 * 32 * 3];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for bad in [&bytes[..bytes.len() / 3], &b"\xFF\xD8\xFF\xE0 nope"[..], &b"not an image at all"[..]] {
            let e = load_into(bad, &|| "/data/x.jpg".into(), &t, &mut rng, &mut out, &mut StageNanos::default());
            let e = e.expect_err("an error").to_string();
            assert!(e.starts_with("cannot decode image /data/x.jpg: "), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
