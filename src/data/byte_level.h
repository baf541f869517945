#pragma once
// The byte-level pieces of a GPT-2-style BPE: the printable stand-in character of every byte
// (so token strings in tokenizer.json are readable and space-free) and the pre-tokenizer that
// cuts text into words before merges apply.
#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// UTF-8 of the character that stands for byte b in tokenizer.json ("Ġ" for a space).
const std::array<std::string, 256>& byte_level_chars();
// Back from such a string of stand-in characters to bytes; false if it holds anything else.
bool byte_level_decode(std::string_view chars, std::string& bytes);
std::string byte_level_encode(std::string_view bytes);

// Splits text into pieces: letter runs, digit runs and runs of other characters, each taking
// one leading space; whitespace runs (all but their last character when a word follows).
// Works on bytes: any byte >= 0x80 counts as "other", so UTF-8 characters stay whole and
// arbitrary bytes are fine. Concatenating the pieces gives the text back.
std::vector<std::string_view> pre_tokenize(std::string_view text);

// The same split as a regular expression for Hugging Face's Split pre-tokenizer (whitespace
// spelled out rather than \s, which would also match Unicode spaces the byte version treats as
// "other").
extern const char* const kPreTokenizerRegex;

}  // namespace moe
