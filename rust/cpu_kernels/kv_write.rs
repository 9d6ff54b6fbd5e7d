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

/// Copies `rows` (`[slots.len(), num_heads, head_size]` elements) into `cache` at `slots`. A
/// negative slot is a padding token and is skipped (as the CUDA kernel does); a slot past the
/// cache is an error, checked before anything is written.
pub fn write_kv(cache: &mut [u8], rows: &[u8], slots: &[i64], shape: CacheShape) -> Result<()> {
    let CacheShape { num_blocks, num_heads, block_size, head_size, element_bytes } = shape;
    let head_bytes = head_size * element_bytes;
    let row_bytes = num_heads * head_bytes;
    if cache.len() != num_blocks * block_size * row_bytes || rows.len() != slots.len() * row_bytes {
        return Err(Error::InvalidState(format!(
            "write_kv: cache of {} bytes, rows of {} bytes for {} slots do not match the shape {shape:?}",
            cache.len(),
            rows.len(),
            slots.len()
        )));
    }
    let num_slots = (num_blocks * block_size) as i64;
    if let Some(bad) = slots.iter().find(|&&slot| slot >= num_slots) {
        return Err(Error::InvalidState(format!("write_kv: slot {bad} is past the cache's {num_slots} slots")));
    }
    for (token, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        for head in 0..num_heads {
            let to = ((block * num_heads + head) * block_size + offset) * head_bytes;
            let from = token * row_bytes + head * head_bytes;
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
        write_kv(&mut cache, &rows, &slots, SHAPE).unwrap();
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
    fn a_slot_past_the_cache_is_an_error_and_writes_nothing() {
        let mut cache = vec![0u8; 3 * 4 * 2 * 3 * 2];
        let rows = vec![7u8; 2 * 2 * 3 * 2];
        assert!(write_kv(&mut cache, &rows, &[1, 12], SHAPE).is_err());
        assert!(cache.iter().all(|&byte| byte == 0));
        assert!(write_kv(&mut cache, &rows[1..], &[1, 2], SHAPE).is_err()); // (rows of the wrong size)
    }
}
