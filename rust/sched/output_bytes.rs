//! A step's plan as bytes, so the other ranks of a tensor-parallel group run the step rank 0
//! scheduled with the same code (and pickle can carry a `SchedulerOutput`). The format is a
//! version word, then little-endian u64 words: lengths, then values. `from_bytes` checks every
//! length and range before it builds anything, so bad bytes are an error, never a panic.

use std::ops::Range;
use std::sync::Arc;

use crate::errors::{Error, Result};
use crate::kv::block_manager::BlockCopy;
use crate::sched::scheduler::{ScheduledSequence, SchedulerOutput};

const FORMAT_VERSION: u64 = 2;
/// Words each scheduled sequence takes.
const SEQUENCE_WORDS: usize = 12;

impl SchedulerOutput {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Writer(Vec::new());
        out.word(FORMAT_VERSION);
        out.word(self.num_kv_groups as u64);
        out.word(self.scheduled.len() as u64);
        for seq in &self.scheduled {
            out.word(seq.seq_id);
            out.word(seq.is_prefill as u64);
            out.word(seq.start as u64);
            out.word(seq.end as u64);
            out.word(seq.sample as u64);
            out.range(&seq.token_range);
            out.word(seq.block_table_from as u64);
            out.word(seq.num_blocks as u64);
            out.range(&seq.block_range);
            out.word(seq.row as u64);
        }
        out.words(self.token_ids.iter().map(|&token| token as u64));
        out.words(self.slot_mapping.iter().map(|&slot| slot as u64));
        out.words(self.block_table_updates.iter().map(|&block| block as u64));
        for copies in [&self.blocks_to_swap_in, &self.blocks_to_swap_out, &self.blocks_to_copy] {
            out.word(2 * copies.len() as u64); // (read back as block ids, then paired)
            copies.iter().for_each(|&(from, to)| [from, to].iter().for_each(|&block| out.word(block as u64)));
        }
        out.strings(self.preempted.iter().map(|id| &**id));
        out.strings(self.aborted.iter().map(|id| &**id));
        out.strings(self.abort_reasons.iter().map(String::as_str));
        out.word(self.num_batched_tokens as u64);
        out.word(self.num_prefix_hit_tokens as u64);
        out.0
    }

    /// The output `to_bytes` wrote; an InvalidState error names what does not hold.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut input = Reader { bytes, at: 0 };
        let version = input.word()?;
        if version != FORMAT_VERSION {
            return Err(invalid(format!("format version {version}, expected {FORMAT_VERSION}")));
        }
        let num_kv_groups = input.usize()?;
        let num_scheduled = input.len(SEQUENCE_WORDS)?;
        let mut scheduled = Vec::with_capacity(num_scheduled);
        for _ in 0..num_scheduled {
            scheduled.push(ScheduledSequence {
                seq_id: input.word()?,
                is_prefill: input.flag()?,
                start: input.usize()?,
                end: input.usize()?,
                sample: input.flag()?,
                token_range: input.range()?,
                block_table_from: input.usize()?,
                num_blocks: input.usize()?,
                block_range: input.range()?,
                row: u32::try_from(input.word()?).map_err(|_| invalid("a row past u32".into()))?,
            });
        }
        let token_ids = input.words(|word| u32::try_from(word).ok())?;
        let slot_mapping = input.words(|word| Some(word as i64))?;
        let block_table_updates = input.words(|word| u32::try_from(word).ok())?;
        let [blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy] =
            [input.copies()?, input.copies()?, input.copies()?];
        let preempted = input.strings()?.into_iter().map(Arc::from).collect();
        let aborted = input.strings()?.into_iter().map(Arc::from).collect();
        let abort_reasons = input.strings()?;
        let (num_batched_tokens, num_prefix_hit_tokens) = (input.usize()?, input.usize()?);
        if input.at != bytes.len() {
            return Err(invalid(format!("{} bytes past the end of the step", bytes.len() - input.at)));
        }
        if num_kv_groups == 0 || num_kv_groups.checked_mul(token_ids.len()) != Some(slot_mapping.len()) {
            return Err(invalid(format!(
                "{} slots for {} tokens in {num_kv_groups} KV-cache groups",
                slot_mapping.len(),
                token_ids.len()
            )));
        }
        if let Some(seq) = scheduled.iter().find(|seq| {
            seq.token_range.end > token_ids.len()
                || seq.block_range.end > block_table_updates.len()
                || seq.block_table_from > seq.num_blocks
                || num_kv_groups.checked_mul(seq.num_blocks - seq.block_table_from) != Some(seq.block_range.len())
                || seq.start > seq.end
                || seq.token_range.len() != seq.end - seq.start
        }) {
            return Err(invalid(format!(
                "sequence {} reads tokens {:?} of {}, blocks {:?} of {}, positions {}..{}",
                seq.seq_id,
                seq.token_range,
                token_ids.len(),
                seq.block_range,
                block_table_updates.len(),
                seq.start,
                seq.end
            )));
        }
        Ok(SchedulerOutput {
            scheduled,
            token_ids,
            slot_mapping,
            num_kv_groups,
            block_table_updates,
            blocks_to_swap_in,
            blocks_to_swap_out,
            blocks_to_copy,
            preempted,
            aborted,
            abort_reasons,
            num_batched_tokens,
            num_prefix_hit_tokens,
        })
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidState(format!("step bytes: {message}"))
}

struct Writer(Vec<u8>);

impl Writer {
    fn word(&mut self, word: u64) {
        self.0.extend_from_slice(&word.to_le_bytes());
    }

    fn range(&mut self, range: &Range<usize>) {
        self.word(range.start as u64);
        self.word(range.end as u64);
    }

    fn words(&mut self, words: impl ExactSizeIterator<Item = u64>) {
        self.word(words.len() as u64);
        words.for_each(|word| self.word(word));
    }

    fn strings<'a>(&mut self, strings: impl ExactSizeIterator<Item = &'a str>) {
        self.word(strings.len() as u64);
        for string in strings {
            self.word(string.len() as u64);
            self.0.extend_from_slice(string.as_bytes());
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, len: usize) -> Result<&[u8]> {
        if len > self.bytes.len() - self.at {
            return Err(invalid(format!("{len} bytes wanted at byte {} of {}", self.at, self.bytes.len())));
        }
        self.at += len;
        Ok(&self.bytes[self.at - len..self.at])
    }

    fn word(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.word()?).map_err(|_| invalid("a length past usize".into()))
    }

    fn flag(&mut self) -> Result<bool> {
        match self.word()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(invalid(format!("flag {other}"))),
        }
    }

    fn range(&mut self) -> Result<Range<usize>> {
        let (start, end) = (self.usize()?, self.usize()?);
        if start > end {
            return Err(invalid(format!("range {start}..{end}")));
        }
        Ok(start..end)
    }

    /// A count of items of `item_bytes` each, refused when the bytes left cannot hold them (so a
    /// bad count never allocates).
    fn len(&mut self, item_words: usize) -> Result<usize> {
        let len = self.usize()?;
        if len.saturating_mul(item_words * 8) > self.bytes.len() - self.at {
            return Err(invalid(format!("{len} items of {item_words} words past the end")));
        }
        Ok(len)
    }

    fn words<T>(&mut self, convert: impl Fn(u64) -> Option<T>) -> Result<Vec<T>> {
        let len = self.len(1)?;
        (0..len)
            .map(|_| {
                let word = self.word()?;
                convert(word).ok_or_else(|| invalid(format!("value {word} out of range")))
            })
            .collect()
    }

    fn copies(&mut self) -> Result<Vec<BlockCopy>> {
        let words = self.words(|word| u32::try_from(word).ok())?;
        if words.len() % 2 != 0 {
            return Err(invalid(format!("{} block ids for pairs", words.len())));
        }
        Ok(words.chunks_exact(2).map(|pair| (pair[0], pair[1])).collect())
    }

    fn strings(&mut self) -> Result<Vec<String>> {
        let len = self.len(1)?;
        (0..len)
            .map(|_| {
                let string_len = self.usize()?;
                let bytes = self.take(string_len)?;
                String::from_utf8(bytes.to_vec()).map_err(|_| invalid("a string that is not UTF-8".into()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::scheduler::SchedulerOutput;
    use crate::sched::scheduler_tests::random_workload_outputs;

    #[test]
    fn every_step_of_a_random_workload_comes_back_from_its_bytes() {
        let outputs = random_workload_outputs(7, 60);
        assert!(outputs.iter().any(|out| !out.blocks_to_swap_out.is_empty() || !out.preempted.is_empty()));
        for out in &outputs {
            assert_eq!(&SchedulerOutput::from_bytes(&out.to_bytes()).unwrap(), out);
        }
    }

    #[test]
    fn cut_or_altered_bytes_are_an_error_not_a_panic() {
        let outputs = random_workload_outputs(11, 20);
        let out = outputs.iter().max_by_key(|out| out.scheduled.len()).unwrap();
        let bytes = out.to_bytes();
        for len in 0..bytes.len() {
            assert!(SchedulerOutput::from_bytes(&bytes[..len]).is_err(), "{len} bytes of {}", bytes.len());
        }
        // Every word set to a large value: refused (or, where any value is valid, a different output).
        for word in 0..bytes.len() / 8 {
            let mut altered = bytes.clone();
            altered[word * 8..word * 8 + 8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
            if let Ok(decoded) = SchedulerOutput::from_bytes(&altered) {
                assert_ne!(&decoded, out, "word {word}");
            }
        }
    }
}
