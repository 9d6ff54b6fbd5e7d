//! A step's new keys and values written into the paged cache: each token's `[heads, head]` rows
//! copied to its slot (block `slot / block_size`, offset `slot % block_size`) of a cache laid out
//! `[num_blocks, heads, block_size, head]`. Elements are moved as bytes, so any element type whose
//! source and cache agree (float32, bfloat16, float8) takes the same path.

use crate::errors::{Error, Result};

/// The cache's shape, in elements, and the bytes of one element.
#[derive(Debug, Clone, Copy)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub num_heads: usize,
    pub block_size: usize,
    pub head_size: usize,
    pub element_bytes: usize,
}

/// Element strides of the two sides: a cache block (a layer's view of the engine's block-major
/// cache holds the other layers between its blocks), and a row's token and head (keys and values
/// are views of the fused qkv projection). Within a block, and within a head's row, elements are
/// contiguous.
#[derive(Debug, Clone, Copy)]
pub struct Strides {
    pub cache_block: usize,
    pub row_token: usize,
    pub row_head: usize,
}

impl Strides {
    /// The strides of contiguous tensors of `shape`.
    pub fn contiguous(shape: CacheShape) -> Self {
        let row_head = shape.head_size;
        Strides {
            cache_block: shape.num_heads * shape.block_size * row_head,
            row_token: shape.num_heads * row_head,
            row_head,
        }
    }
}

/// Bytes `cache` and `rows` span from their first element, for `num_tokens` rows.
pub fn spans(shape: CacheShape, strides: Strides, num_tokens: usize) -> (usize, usize) {
    let CacheShape { num_blocks, num_heads, block_size, head_size, element_bytes } = shape;
    let cache =
        (num_blocks.saturating_sub(1) * strides.cache_block + num_heads * block_size * head_size) * element_bytes;
    let rows = if num_tokens == 0 {
        0
    } else {
        ((num_tokens - 1) * strides.row_token + (num_heads - 1) * strides.row_head + head_size) * element_bytes
    };
    (cache, rows)
}

/// Copies the rows of `[slots.len(), num_heads, head_size]` elements into `cache` at `slots`. A
/// negative slot is a padding token and is skipped (as the CUDA kernel does); a slot past the
/// cache, or sides smaller than their shape and strides span, are errors checked before anything
/// is written.
pub fn write_kv(cache: &mut [u8], rows: &[u8], slots: &[i64], shape: CacheShape, strides: Strides) -> Result<()> {
    let CacheShape { num_blocks, num_heads, block_size, head_size, element_bytes } = shape;
    let (cache_span, rows_span) = spans(shape, strides, slots.len());
    if cache.len() < cache_span
        || rows.len() < rows_span
        || strides.cache_block < num_heads * block_size * head_size
        || strides.row_head < head_size
    {
        return Err(Error::InvalidState(format!(
            "write_kv: cache of {} bytes, rows of {} bytes for {} slots do not fit {shape:?} with {strides:?}",
            cache.len(),
            rows.len(),
            slots.len()
        )));
    }
    let num_slots = (num_blocks * block_size) as i64;
    if let Some(bad) = slots.iter().find(|&&slot| slot >= num_slots) {
        return Err(Error::InvalidState(format!("write_kv: slot {bad} is past the cache's {num_slots} slots")));
    }
    let head_bytes = head_size * element_bytes;
    for (token, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        for head in 0..num_heads {
            let to = (block * strides.cache_block + (head * block_size + offset) * head_size) * element_bytes;
            let from = (token * strides.row_token + head * strides.row_head) * element_bytes;
            cache[to..to + head_bytes].copy_from_slice(&rows[from..from + head_bytes]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: CacheShape = CacheShape { num_blocks: 3, num_heads: 2, block_size: 4, head_size: 3, element_bytes: 2 };

    fn element(cache: &[u8], block: usize, head: usize, offset: usize, i: usize) -> [u8; 2] {
        let at = (((block * 2 + head) * 4 + offset) * 3 + i) * 2;
        [cache[at], cache[at + 1]]
    }

    #[test]
    fn each_token_lands_in_its_slot_and_nothing_else_changes() {
        let mut cache = vec![0u8; 3 * 4 * 2 * 3 * 2];
        let slots = [5i64, -1, 11, 0];
        let rows: Vec<u8> = (0..slots.len() * 2 * 3 * 2).map(|i| i as u8 + 1).collect();
        write_kv(&mut cache, &rows, &slots, SHAPE, Strides::contiguous(SHAPE)).unwrap();
        let mut written = 0;
        for (token, &slot) in slots.iter().enumerate().filter(|(_, &slot)| slot >= 0) {
            let (block, offset) = (slot as usize / 4, slot as usize % 4);
            for head in 0..2 {
                for i in 0..3 {
                    let from = ((token * 2 + head) * 3 + i) * 2;
                    assert_eq!(element(&cache, block, head, offset, i), [rows[from], rows[from + 1]]);
                    written += 2;
                }
            }
        }
        assert_eq!(cache.iter().filter(|&&byte| byte != 0).count(), written); // (no other byte moved)
    }

    #[test]
    fn strided_views_write_only_their_own_elements() {
        // The cache every other block of a [3, 2 (layers), ...] tensor, the rows every other head
        // row of a wider projection.
        let strides = Strides { cache_block: 2 * 2 * 4 * 3, row_token: 4 * 3, row_head: 2 * 3 };
        let mut whole = vec![0u8; 3 * 2 * 2 * 4 * 3 * 2];
        let rows: Vec<u8> = (0..2 * 4 * 3 * 2).map(|i| i as u8 + 1).collect();
        write_kv(&mut whole, &rows, &[6, 1], SHAPE, strides).unwrap();
        for (token, slot) in [(0usize, 6usize), (1, 1)] {
            let (block, offset) = (slot / 4, slot % 4);
            for head in 0..2 {
                let to = (block * strides.cache_block + (head * 4 + offset) * 3) * 2;
                let from = (token * strides.row_token + head * strides.row_head) * 2;
                assert_eq!(whole[to..to + 6], rows[from..from + 6]);
            }
        }
        assert_eq!(whole.iter().filter(|&&byte| byte != 0).count(), 2 * 2 * 6); // (the other layer untouched)
    }

    #[test]
    fn a_slot_past_the_cache_is_an_error_and_writes_nothing() {
        let mut cache = vec![0u8; 3 * 4 * 2 * 3 * 2];
        let rows = vec![7u8; 2 * 2 * 3 * 2];
        assert!(write_kv(&mut cache, &rows, &[1, 12], SHAPE, Strides::contiguous(SHAPE)).is_err());
        assert!(cache.iter().all(|&byte| byte == 0));
        assert!(write_kv(&mut cache, &rows[1..], &[1, 2], SHAPE, Strides::contiguous(SHAPE)).is_err());
        // (rows too short)
    }
}
